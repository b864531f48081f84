"""The model sizes by name (spec §1.1.2, plus `tiny` for smoke runs and tests): the one table that every CLI
(`--size`), the pipeline's config validation and the report read. Free of torch, so Snakemake reads it cheaply."""

MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 64, "d_ff": 256, "num_layers": 2, "num_heads": 4},
    "small": {"d_model": 768, "d_ff": 3072, "num_layers": 12, "num_heads": 12},
    "medium": {"d_model": 1024, "d_ff": 4096, "num_layers": 24, "num_heads": 16},
    "large": {"d_model": 1280, "d_ff": 5120, "num_layers": 36, "num_heads": 20},
    "xl": {"d_model": 1600, "d_ff": 6400, "num_layers": 48, "num_heads": 25},
    "2.7B": {"d_model": 2560, "d_ff": 10240, "num_layers": 32, "num_heads": 32},
}
