"""Offline HF <-> Megatron checkpoint conversion on the command line (the directory functions live in
:mod:`agentrl.trainer.hf_checkpoint`; the weight mapping is the trainer's own).

    python -m agentrl.convert hf-to-mcore --hf HF_DIR --out MCORE_DIR [--tp N --pp N --ep N]
    python -m agentrl.convert mcore-to-hf --mcore MCORE_DIR --hf-template HF_DIR --out HF_DIR

HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="agentrl.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors dir -> Megatron dir")
    a.add_argument("--hf", required=True, help="HF model dir")
    a.add_argument("--out", required=True, help="output Megatron dir")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    a.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    a.add_argument("--ep", type=int, default=1, help="expert-parallel size (mixture-of-experts models)")
    a.add_argument("--vocab-divisible-by", type=int, default=1, help="pad vocab to a multiple of tp * this")
    b = sub.add_parser("mcore-to-hf", help="Megatron dir -> HF safetensors dir")
    b.add_argument("--mcore", required=True, help="Megatron dir written by hf-to-mcore (or the trainer)")
    b.add_argument("--hf-template", required=True, help="HF dir to copy config and tokenizer files from")
    b.add_argument("--out", required=True, help="output HF dir")
    args = parser.parse_args(argv)
    # torch and megatron-core load only for a conversion, never for --help or a usage error
    from agentrl.trainer.hf_checkpoint import hf_to_mcore, mcore_to_hf_dir

    if args.cmd == "hf-to-mcore":
        out = hf_to_mcore(args.hf, args.out, args.tp, args.pp, args.vocab_divisible_by, args.ep)
    else:
        out = mcore_to_hf_dir(args.mcore, args.hf_template, args.out)
    print(out)


if __name__ == "__main__":
    main()
