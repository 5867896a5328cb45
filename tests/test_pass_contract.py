"""Every pattern pass has the contract passes/__init__.py states, so the backend can call each one alike."""
import inspect

from fastgrpo.passes import PASSES


def test_every_pass_has_the_stated_signature():
    for name, module in PASSES.items():
        assert module.NAME == name
        parameters = list(inspect.signature(module.apply).parameters)
        assert parameters == ["gm", "record", "options"], (name, parameters)
