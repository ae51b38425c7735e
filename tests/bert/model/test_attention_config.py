"""model.attention against data.layout, checked when the configuration is loaded (from what
``kernels.registry`` says each backend takes). The command-line runs (an unknown backend, a
backend this machine cannot run: one line, exit 2) are in test_trainer.py."""

import pytest

from bert.config import load_config
from common.errors import ConfigError


@pytest.mark.parametrize(
    "layout, attention, words",
    [
        ("packed", "triton", ("model.attention: triton needs data.layout=unpadded", "reference, flashmask")),
        ("padded", "torch_varlen", ("torch_varlen needs data.layout=unpadded", "reference, padded")),
        ("unpadded", "flashmask", ("model.attention: flashmask needs data.layout=packed",)),
        ("packed", "padded", ("padded needs data.layout=unpadded or padded",)),
    ],
)
def test_a_layout_the_backend_does_not_take_is_refused_when_loaded(layout, attention, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"data.layout={layout}", f"model.attention={attention}"])
    for word in words:
        assert word in str(e.value)


def test_every_backend_loads_with_a_layout_it_takes():
    for layout, attention in [("unpadded", "triton_grouped"), ("padded", "padded"), ("packed", "reference")]:
        assert load_config(None, [f"data.layout={layout}", f"model.attention={attention}"]).model.attention == attention
