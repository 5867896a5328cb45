"""`fastgrpo` command line: `report` (what the backend matches on a model) and `train` (the GRPO main job).

Bad input (`fastgrpo.errors.UserError`: a path that does not exist, an unknown config key or option, a YAML error)
is printed as one line naming the fix, exit status 2; `--debug` (anywhere on the line) shows its traceback too.
Other exceptions keep their traceback. A Ctrl-C that stops a command exits with status 130 (`train` saves a
checkpoint at the first Ctrl-C and stops at once at the second: fastgrpo.integrations.checkpoints).
"""
import argparse
import json
import sys

import torch

from fastgrpo.errors import UserError
from fastgrpo.versions import warn_untested_versions

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _load(args):
    if args.model:
        import transformers

        from fastgrpo.integrations.models import resolve_model_path

        path = resolve_model_path(args.model, tokenizer=False)  # a report needs no tokenizer
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[args.dtype])
        model.train()
        if args.lora:
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
        return model
    from fastgrpo.compiler.tiny import tiny_model

    return tiny_model(args.arch, dtype=_DTYPES[args.dtype], lora=args.lora)


def report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="fastgrpo report",
        description="Compile a model with the fastgrpo backend, run one training step, and print what was accelerated.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--arch", default="llama", help="transformers model_type of a tiny random-init model (default llama)")
    source.add_argument("--model", help="a local Hugging Face model directory instead")
    parser.add_argument("--lora", action="store_true", help="wrap the model in PEFT LoRA first")
    parser.add_argument("--dtype", choices=list(_DTYPES), default="fp32")
    parser.add_argument("--inner", default="aot_eager", help="inner compiler: inductor, aot_eager or eager")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)

    import torch._dynamo
    from torch._dynamo.utils import counters

    import fastgrpo
    from fastgrpo.compiler.report import GraphBreakLog

    model = _load(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (2, args.seq_len), device=device)
    fastgrpo.clear_fusion_reports()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="fastgrpo", options={"inner": args.inner})
    with GraphBreakLog() as log:
        compiled(input_ids=ids, use_cache=False).logits.float().mean().backward()
    reports = fastgrpo.fusion_reports()
    breaks = [{"reason": reason, "count": n} for reason, n in log.result().items()]
    if args.json:
        print(json.dumps({"reports": reports, "graph_breaks": breaks}, indent=2))
    else:
        print(fastgrpo.format_reports(reports))
        print(f"graphs compiled: {len(reports)}; graph breaks: {sum(b['count'] for b in breaks)}")
        for b in breaks:
            print(f"  graph break ({b['count']}x): {b['reason']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    warn_untested_versions()
    commands = {"report": report}
    try:
        from fastgrpo.integrations.main_job import main as train
    except ImportError:
        train = None
    if train is not None:
        commands["train"] = train
    if not argv or argv[0] not in commands:
        print(f"usage: fastgrpo {{{','.join(commands)}}} [--debug] [options]   (fastgrpo COMMAND --help for details)")
        return 2
    try:
        return commands[argv[0]](argv[1:])
    except UserError as error:
        if debug:
            raise
        print(f"fastgrpo {argv[0]}: error: " + " ".join(str(error).split()), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"fastgrpo {argv[0]}: stopped (Ctrl-C)", file=sys.stderr)
        return 130
    except torch.OutOfMemoryError as error:  # a fault of the size asked for, not a bug: the fixes, no traceback
        if debug:
            raise
        print(f"fastgrpo {argv[0]}: error: out of memory ({str(error).splitlines()[0] if str(error) else ''})",
              file=sys.stderr)
        for note in getattr(error, "__notes__", []):
            print("  " + " ".join(note.split()), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
