"""The policy-model commands of `gyre`: a random model of any family, and the check of a user's folder.

gyre model init --out DIR [--preset tiny] [--family qwen2|qwen3|llama|mistral] [--seed N]
gyre model check DIR [--tool-call-format FORMAT]   what gyre reads from a Hugging Face folder, or why not
"""

from __future__ import annotations

import argparse


def add_model_parsers(model_commands) -> None:
    from engines.model.families import FAMILIES
    from engines.model.tool_calls import FORMATS

    init = model_commands.add_parser(
        "init", help="write a seeded random-init model (Qwen2 unless --family) and its tokenizer"
    )
    init.add_argument(
        "--preset",
        choices=["tiny", "small", "gpu-0.5b", "gpu-1.5b"],
        default="tiny",
        help="model size (engines/model/config.py PRESETS)",
    )
    init.add_argument(
        "--family",
        choices=list(FAMILIES),
        default="qwen2",
        help="architecture, control tokens and chat format (engines/model/families.py)",
    )
    init.add_argument("--out", required=True, help="a folder or fsspec URL (s3://bucket/prefix)")
    init.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    init.add_argument("--force", action="store_true", help="replace the model files already at --out")
    init.add_argument("--s3-endpoint-url", default=None, help="S3 API endpoint (default: AWS variables)")
    check = model_commands.add_parser(
        "check", help="check a local Hugging Face folder as a policy: architecture, chat template, tool calls"
    )
    check.add_argument("folder", help="the model folder (config.json, tokenizer, chat template, safetensors)")
    check.add_argument(
        "--tool-call-format",
        choices=FORMATS,
        default=None,
        help="write this format into the folder's tokenizer_config.json (gyre_tool_call_format) first, "
        "for a folder whose format cannot be inferred (default: infer it)",
    )


def run_model_command(args: argparse.Namespace) -> int:
    if args.model_command == "check":
        return _check(args)
    from tasks.model import init_model  # imports torch and transformers: only when asked for

    summary = init_model.fn(
        args.preset, args.out, args.seed, args.force, args.s3_endpoint_url, family=args.family
    )
    print(
        f"initialized {summary.preset} {summary.family} model (seed {summary.seed}): "
        f"{summary.parameters:,} parameters, vocab {summary.vocab_size}, {summary.dtype}, at {summary.out}"
    )
    return 0


def _check(args: argparse.Namespace) -> int:
    from engines.model.policy import inspect_policy, set_tool_call_format

    if args.tool_call_format:
        inspect_policy_without_format(args.folder)
        set_tool_call_format(args.folder, args.tool_call_format)
    info = inspect_policy(args.folder)
    print(
        f"{info.folder}: {info.architecture} (model_type {info.model_type}), chat template in "
        f"{info.chat_template_source}, tool calls {info.tool_call_format} (from {info.format_source})"
    )
    return 0


def inspect_policy_without_format(folder: str) -> None:
    """Every check of inspect_policy but the tool-call format's (which the caller is about to set)."""
    from engines.model.policy import PolicyError, inspect_policy

    try:
        inspect_policy(folder)
    except PolicyError as error:
        if "cannot tell how this model writes tool calls" not in str(error):
            raise
