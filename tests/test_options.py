"""The backend options a training step takes (`training_options`): the gated MLP's form per situation."""
import itertools

import pytest

from fastgrpo.compiler.options import MLP_FORM_OPTIONS, Options, training_options

KEEPS_X, KEEPS_GATE_UP, ACT_MUL = {}, {"save_mlp_projections": True}, {"absorb_mlp_projections": False}


@pytest.mark.parametrize("device,offload,packing,form", [
    ("cuda", True, False, KEEPS_X),
    ("cuda", True, True, KEEPS_X),
    ("cuda", False, False, KEEPS_GATE_UP),
    ("cuda", False, True, ACT_MUL),
    ("cpu", False, False, ACT_MUL),
    ("cpu", False, True, ACT_MUL),
    ("cpu", True, False, ACT_MUL),
    ("cpu", True, True, ACT_MUL),
])
def test_form_under_checkpointing(device, offload, packing, form):
    situation = dict(device_type=device, checkpointing=True, offload=offload, packing=packing)
    assert training_options(None, **situation) == form
    # The user's other options are kept beside the form, and the result is a valid set of backend options.
    mine = {"inner": "eager", "join_projections": False}
    assert training_options(mine, **situation) == {**form, **mine}
    Options.parse(training_options(mine, **situation))


def test_without_checkpointing_the_options_are_the_users():
    for device, offload, packing in itertools.product(("cuda", "cpu"), (True, False), (True, False)):
        situation = dict(device_type=device, checkpointing=False, offload=offload, packing=packing)
        assert training_options(None, **situation) is None
        assert training_options({"inner": "eager"}, **situation) == {"inner": "eager"}


@pytest.mark.parametrize("choice", [{"absorb_mlp_projections": True}, {"save_mlp_projections": False},
                                    {"absorb_mlp_projections": False, "print_report": True}])
def test_a_users_form_wins(choice):
    assert set(choice) & set(MLP_FORM_OPTIONS)
    for device, offload, packing in itertools.product(("cuda", "cpu"), (True, False), (True, False)):
        assert training_options(choice, device_type=device, checkpointing=True, offload=offload,
                                packing=packing) == choice
