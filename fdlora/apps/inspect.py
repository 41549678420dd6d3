"""`fdlora inspect SOURCE`: print the load report of an adapter without loading a model."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="Hub repo id, local directory or file")
    parser.add_argument("--revision", help="branch, tag or commit (Hub sources)")
    parser.add_argument("--weight-name", help="weight file in the repo or directory (default: chosen by rule)")
    parser.add_argument("--subfolder", help="folder inside the repo or directory")
    parser.add_argument("--allow-pickle", action="store_true", help="also read .bin/.ckpt pickles (trusted sources)")
    parser.add_argument("--strict", action="store_true", help="fail if any key is unused or dropped")
    parser.add_argument("--local-files-only", action="store_true", help="use the local Hugging Face cache only")
    parser.add_argument("--lora-conversion", metavar="svd:RANK",
                        help="report what turning LoHa / LoKr / full-diff modules into rank-RANK LoRA would lose")


def run(args: argparse.Namespace) -> int:
    import warnings

    from ..errors import PartialLoadWarning
    from ..hub.load import load_adapters

    with warnings.catch_warnings():  # the report printed below lists every key a load would warn about
        warnings.simplefilter("ignore", PartialLoadWarning)
        _, report = load_adapters(args.source, revision=args.revision, weight_name=args.weight_name,
                                  subfolder=args.subfolder, allow_pickle=args.allow_pickle,
                                  local_files_only=args.local_files_only, cache=None,
                                  lora_conversion=getattr(args, "lora_conversion", None))
    print(report)
    if args.strict:
        report.check_strict("--strict", "Drop --strict to accept an adapter that loads without these keys.")
    return 0
