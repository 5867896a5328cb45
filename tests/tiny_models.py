"""The architecture matrix the pass tests cover, on tiny random-init models (no downloads)."""
import torch

from fastgrpo.compiler.tiny import tiny_model

VOCAB = 128
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo2"]


def count_modules(model, name_part: str) -> int:
    return sum(1 for m in model.modules() if name_part in type(m).__name__)


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(expected: dict, actual: dict, rel: float) -> None:
    """Every gradient within `rel` of the largest magnitude of its eager counterpart."""
    assert expected.keys() == actual.keys()
    for name in expected:
        scale = expected[name].float().abs().max().clamp_min(1e-12)
        err = (actual[name].float() - expected[name].float()).abs().max() / scale
        assert err <= rel, f"{name}: relative error {err:.2e}"


def eager_then_compiled(module, x, options=None):
    """`module(x)` eager, then through the fastgrpo backend with fresh reports; each followed by
    `.sum().backward()`. Returns (expected, expected x.grad, actual, actual x.grad)."""
    import fastgrpo

    expected = module(x)
    expected.sum().backward()
    expected_grad, x.grad = x.grad.clone(), None
    fastgrpo.clear_fusion_reports()
    torch._dynamo.reset()
    actual = torch.compile(module, backend="fastgrpo", options={"inner": "eager", **(options or {})})(x)
    actual.sum().backward()
    return expected, expected_grad, actual, x.grad


def eager_then_compiled_model(model, fn, inputs: dict, loss=lambda out: out.float().sum(), options=None,
                              dynamic=None):
    """`fn(**inputs)` eager, then through the fastgrpo backend (inner eager unless `options` say otherwise) with
    fresh reports; each followed by `loss(output).backward()`. Returns (expected, expected model grads, actual,
    actual model grads), the model's grads cleared in between."""
    import fastgrpo

    expected = fn(**inputs)
    loss(expected).backward()
    expected_grads = grads(model)
    model.zero_grad()
    fastgrpo.clear_fusion_reports()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fastgrpo", options={"inner": "eager", **(options or {})}, dynamic=dynamic)
    actual = compiled(**inputs)
    loss(actual).backward()
    return expected.detach(), expected_grads, actual.detach(), grads(model)


def assert_compiled_matches_eager(fn, *inputs):
    """fn through the fastgrpo backend (inner eager, fresh reports) vs eager: outputs, and the gradients of the
    inputs that require grad (each run followed by `.float().sum().backward()`)."""
    import fastgrpo

    expected = fn(*inputs)
    expected.float().sum().backward()
    expected_grads = [t.grad.clone() for t in inputs if t.requires_grad]
    for t in inputs:
        t.grad = None
    fastgrpo.clear_fusion_reports()
    torch._dynamo.reset()
    actual = torch.compile(fn, backend="fastgrpo", options={"inner": "eager"})(*inputs)
    actual.float().sum().backward()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip([t.grad for t in inputs if t.requires_grad], expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def tiny_tokenizer(texts: list[str], vocab: int, bpe_vocab: int = 300):
    """A byte-level BPE tokenizer trained on `texts`, padded with added tokens to exactly `vocab`
    entries so any id a model samples decodes (vLLM needs that); pad `<pad>`, eos `<eos>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(vocab_size=bpe_vocab, special_tokens=["<unk>", "<pad>", "<eos>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )  # fmt: skip
    tok.add_tokens([f"<x{i}>" for i in range(vocab - tok.get_vocab_size())])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


__all__ = ["tiny_model", "VOCAB", "ARCHS", "count_modules", "grads", "assert_grads_close", "eager_then_compiled",
           "eager_then_compiled_model", "assert_compiled_matches_eager", "tiny_tokenizer"]


def trainer_rule(rule: str, tmp_path, device: str, **config):
    """What GRPOTrainer's `rule` (a method such as `_packing_on`) decides for a GRPOConfig built from `config`,
    when the trainer runs on `device`; no trainer is built."""
    from types import MethodType, SimpleNamespace

    import fastgrpo.integrations.trl as F

    args = F.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **config)
    trainer = SimpleNamespace(args=args, accelerator=SimpleNamespace(device=torch.device(device)))
    for consulted in ("_packing_on", "_offload_on"):  # rules other rules consult
        setattr(trainer, consulted, MethodType(getattr(F.GRPOTrainer, consulted), trainer))
    return getattr(F.GRPOTrainer, rule)(trainer)
