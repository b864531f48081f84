"""§2.4: memory and compute-bound batch size of the XXL FFN stack (a)-(c) from the accounting CSV; (d) in prose."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.context import Context
from cs336_systems.report.formatting import provenance_line, text_md


def render(ctx: Context) -> str:
    frame, metas = ctx.require("communication_accounting", "The communication accounting")
    p = metas[0]["params"]
    v = {(r["part"], r["quantity"]): r["value"] for _, r in frame.iterrows()}
    tokens = p["batch_size"] * p["seq_len"]
    a, b, c = (lambda q, part=part: v[(part, q)] for part in "abc")
    out = [
        provenance_line(metas),
        f"The XXL model of the ADDENDUM: {p['num_blocks']} blocks, each two bias-free linear layers "
        f"d_model = D = {p['d_model']:,} → d_ff = F = {p['d_ff']:,} → D (no attention, embeddings or output layer); "
        "fp32 master weights, accumulated gradients and AdamW state, bf16 activations and communication; no "
        "activation checkpointing. GB = 10^9 bytes. Every number below is a row of "
        f"`results/{ctx.run}/communication_accounting/xxl.csv`, computed by `cs336_systems.accounting.formulas`; the table "
        "at the end lists each with its formula.",
        "",
        "### (a) One device's worth of state, and the activations",
        "",
        f"N = 2·L·D·F = {a('num_params') / 1e9:.1f} B parameters. Master weights (4 bytes), accumulated gradients "
        f"(4 bytes) and AdamW's two moments (2 × 4 bytes) take 16·N = {gb(a('states_bytes'))}, which needs "
        f"{a('states_devices'):.1f} → **{a('states_devices_needed'):.0f} H100s** of {p['h100_memory_gb']:g} GB.",
        "",
        "Backward of y = x·W needs x (for ∂L/∂W = xᵀ·∂L/∂y), so each block saves the input of both linear layers: "
        f"D + F values per token, in bf16 {gb(a('activation_bytes_per_token'), 'MB', 1e6)} per token over all "
        f"blocks, i.e. **A(B, T) = 2·L·(D + F)·B·T bytes = {a('activation_bytes_per_token') / 1e6:.1f} MB × B·T**. "
        f"At B = {p['batch_size']} sequences of T = {p['seq_len']} tokens ({tokens:,} tokens) that is "
        f"{gb(a('activation_bytes'))}, {a('activation_bytes') / (p['h100_memory_gb'] * 1e9):.2f} H100s more: "
        f"{a('total_devices_needed'):.0f} in all.",
        "",
        "### (b) FSDP over N_FSDP TPU v5p",
        "",
        "Sharding the states S and half of the activations A over N_FSDP devices leaves per device",
        "",
        "$$M(N_\\text{FSDP}) = \\frac{S}{N_\\text{FSDP}} + \\frac{A}{2} + \\frac{A}{2\\,N_\\text{FSDP}}"
        "\\quad\\Rightarrow\\quad M \\le M_\\text{dev} \\iff N_\\text{FSDP} \\ge "
        "\\frac{S + A/2}{M_\\text{dev} - A/2}\\ (\\text{possible only if } A/2 < M_\\text{dev}).$$",
        "",
        f"With S = {gb(b('states_bytes'))}, A = {gb(b('activation_bytes'))} (B·T = {tokens:,}) and "
        f"M_dev = {p['tpu_v5p_memory_gb']:g} GB: **N_FSDP = {b('n_fsdp_needed'):.0f}** "
        f"({gb(b('per_device_bytes_at_n_fsdp_needed'))} per device); without activations "
        f"{b('n_fsdp_states_only'):.0f} would do. The unsharded half of the activations grows with B·T and caps "
        f"the batch: A/2 < {p['tpu_v5p_memory_gb']:g} GB means B·T < "
        f"{2 * p['tpu_v5p_memory_gb'] * 1e9 / a('activation_bytes_per_token'):,.0f} tokens per device.",
        "",
        "### (c) When FSDP (X) + tensor parallelism (Y) is compute bound",
        "",
        "Following the scaling book's training chapter (Austin et al., *How to Scale Your Model*, 2025), per "
        "layer pair and B tokens, with N = X·Y chips, C FLOP/s per chip, W bytes/s of ICI per axis, bf16:",
        "",
        "$$T_\\text{math} = \\frac{4BDF}{N C},\\qquad T_\\text{FSDP} = \\frac{4DF}{Y\\,W\\,M_X},\\qquad "
        "T_\\text{TP} = \\frac{4BD}{X\\,W\\,M_Y}.$$",
        "",
        "The all-gathers of the FSDP-sharded weights do not depend on B, the tensor-parallel activation "
        "collectives grow with B like the compute does. Both overlap with compute, so the layer is compute bound "
        "when T_math ≥ T_FSDP + T_TP; in units of 4D/C, with α = C/W:",
        "",
        "$$\\frac{B F}{N} \\ge \\frac{\\alpha F}{Y M_X} + \\frac{\\alpha B}{X M_Y}\\quad\\Rightarrow\\quad "
        "B \\ge \\frac{\\alpha F / (Y M_X)}{F/N - \\alpha/(X M_Y)}.$$",
        "",
        f"With α = {p['flops_per_s']:.3g} / {p['ici_bandwidth_bytes_per_s']:.3g} = {c('alpha'):,.0f} FLOP/byte, "
        f"X = {p['x']}, Y = {p['y']}, M_X = {p['m_x']}, M_Y = {p['m_y']}: F/N = {c('t_math_per_token'):.0f} "
        f"against α/(X·M_Y) = {c('t_tp_per_token'):.0f} per token, so B ≥ {c('min_global_batch'):,.0f} tokens: "
        f"**{c('per_device_batch'):.0f} tokens per device** ({c('min_per_device_batch'):.1f} rounded up) and "
        f"**{c('global_batch'):,.0f} tokens in all** ({c('per_fsdp_shard_batch'):,.0f} per data-parallel shard, "
        f"whose Y = {p['y']} devices work on the same tokens). For comparison, the best split of the same {c('num_devices'):.0f} chips into X·Y would need "
        f"only B/N ≥ 4α²/(F·M_X·M_Y) = {c('optimal_split_min_per_device_batch'):.0f} tokens per device.",
        "",
        "### (d) Lowering the global batch while staying compute bound",
        "",
        DISCUSSION,
        "",
        "#### Every quantity",
        "",
        text_md(
            pd.DataFrame(
                {
                    "part": frame["part"],
                    "quantity": frame["quantity"],
                    "value": [value(r) for _, r in frame.iterrows()],
                    "formula": frame["formula"],
                }
            )
        ),
    ]
    return "\n".join(out)


def gb(n_bytes: float, unit: str = "GB", scale: float = 1e9) -> str:
    if unit == "GB" and n_bytes >= 1e12:
        return f"{n_bytes / 1e12:,.2f} TB"
    return f"{n_bytes / scale:,.1f} {unit}"


def value(row: pd.Series) -> str:
    if row["unit"] == "bytes":
        return gb(row["value"])
    if row["unit"] == "bytes/token":
        return gb(row["value"], "MB/token", 1e6)
    return f"{row['value']:,.4g} {row['unit']}"


DISCUSSION = r"""The bound of (c) is per device and per forward pass: the weights a device all-gathers must be used on
enough tokens at once. The global batch is that per-device batch times the number of data-parallel (FSDP) devices,
so it falls only if fewer devices share the data dimension or each gathered weight serves more work.

- **Gradient accumulation does not help.** Splitting the batch into $k$ microbatches runs the same all-gathers
  once per microbatch, so each microbatch must itself satisfy $B_\mu \ge B_\text{min}$: accumulation raises the
  global batch to $k B_\text{min}$; it never lowers it (keeping the gathered weights across microbatches
  would avoid the repeats, but that is no longer FSDP's memory saving).
- **Pipeline parallelism** over $P$ stages keeps each stage's weights resident, so no weights cross the network
  per step; stages exchange only activations, $2BD$ bytes per boundary. The data-parallel width drops from $N$ to
  $N/P$ and the global batch with it, $B_\text{global} \approx B_\text{dev}\,N/P$, paid for by the bubble
  $(P-1)/(m+P-1)$ with $m$ microbatches (GPipe, Huang et al. 2019; 1F1B in Narayanan et al. 2021).
- **More model parallelism per token.** Tensor parallelism shrinks the FSDP term by $Y$ (above) and sequence /
  context parallelism (Korthikanti et al. 2023; ring attention, Liu et al. 2023) splits one sequence over several
  devices, so a device gets enough tokens from fewer sequences: the batch counted in sequences falls by the
  context-parallel degree at the same tokens per device.
- **More bandwidth per chip** lowers $\alpha = C/W$: more ICI axes for the FSDP dimension ($M_X$) or
  lower-precision weight all-gathers (int8 / fp8, as in ZeRO++, Wang et al. 2023) cut $T_\text{FSDP}$ and the
  bound $B/N \ge 4\alpha^2/(F M_X M_Y)$ falls with $\alpha^2$.
- **Activation checkpointing** trades compute for memory: it frees the $A/2$ of (b), so the model fits on fewer
  devices (smaller $N$ at the same per-device batch, hence a smaller global batch) and its recomputation adds
  about a third more FLOPs per step, which raises $T_\text{math}$ against fixed communication (Chen et al. 2016).

The scaling book's training chapter discusses these trade-offs (its "mixed FSDP and tensor parallelism" and
pipelining sections), including why the critical batch per device scales with $\alpha^2$."""
