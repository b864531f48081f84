# Sourced before every job's shell command (rules/common.smk). Snakemake counts GPUs as a resource but does not
# say which GPU a job may use, so on a box with several, GPU jobs would all land on GPU 0.
#
# pin_gpus N: take N GPUs (the job's need) that no other job of this box holds and expose only them
# (CUDA_VISIBLE_DEVICES). The claim is a lock on /tmp/cs336-gpu-<id>.lock, held by the job's processes and
# released when they exit. With fewer free GPUs than N it exposes the ones it got (the launcher then records
# "needs N GPUs, found M"). With none free (another pipeline on the box, or a process that outlived its job and
# kept a lock) it changes nothing rather than wait, possibly forever. SLURM jobs are left alone: SLURM exposes
# the GPUs it allocated.
pin_gpus() {
    local want=$1 held=() id fd
    if [ "$want" -le 0 ] || [ -n "${SLURM_JOB_ID:-}" ]; then
        return 0
    fi
    local ids
    ids=${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null || true)}
    for id in ${ids//,/ }; do
        [ "${#held[@]}" -lt "$want" ] || break
        { exec {fd}>>"/tmp/cs336-gpu-$id.lock"; } 2>/dev/null || continue
        if flock -n "$fd" 2>/dev/null; then
            held+=("$id")
        else
            exec {fd}>&-
        fi
    done
    if [ "${#held[@]}" -gt 0 ]; then
        CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${held[*]}")
        export CUDA_VISIBLE_DEVICES
        echo "[pin_gpus] job holds GPU(s) $CUDA_VISIBLE_DEVICES" >&2
    fi
}
