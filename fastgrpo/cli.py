"""`fastgrpo` command line: `report` (what the backend matches on a model) and `train` (the GRPO main job)."""
import argparse
import json
import sys

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _load(args):
    if args.model:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=_DTYPES[args.dtype])
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
    commands = {"report": report}
    try:
        from fastgrpo.integrations.main_job import main as train
    except ImportError:
        train = None
    if train is not None:
        commands["train"] = train
    if not argv or argv[0] not in commands:
        print(f"usage: fastgrpo {{{','.join(commands)}}} [options]   (fastgrpo COMMAND --help for details)")
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
