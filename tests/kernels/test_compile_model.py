"""``model.compile=true`` (``torch.compile`` of the model, as the trainer does) trains exactly
like eager on the unpadded layout with the Triton attention (run here in Triton's
interpreter), without graph breaks around its custom ops and with a bounded number of
compilations as the token count changes. (The ``reference`` and ``padded`` backends read the
lengths on the host, ``cu_seqlens.tolist()`` / ``nonzero()``, and so break the graph there
by design; they are not what a compiled run should use.)

How the token count is handled: torch.compile's automatic dynamic shapes. The first batch
compiles with static shapes; the first batch with another token count (and another
``max_seqlen``) recompiles once with the token count, the sequence count and ``max_seqlen``
symbolic, and that graph serves every later batch. The test counts graphs compiled
(``torch._dynamo.utils.counters``) and graph breaks over batches of three different sizes.

Compiled with the ``aot_eager`` backend: dynamo's graph capture and AOTAutograd's joint
forward/backward tracing are what decide graph breaks and recompilations; inductor's code
generation (a C++ compiler on CPU) would only add minutes.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bert.model.config import BertConfig  # noqa: E402
from bert.model.pretraining import BertForPreTraining  # noqa: E402
from tests.batches import random_batch  # noqa: E402

BATCHES = ([1, 40, 17], [9, 33, 5, 28], [12, 7, 50])  # T = 58, 75, 69: static, then dynamic, then reused


def _train(model, step_fn, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for lengths in batches:
        batch = random_batch(lengths, model.config.vocab_size, seed=len(lengths) + lengths[0])
        out = step_fn(batch)
        loss = F.cross_entropy(out.mlm_logits, batch.mlm_labels) + F.cross_entropy(out.nsp_logits, batch.nsp_labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.parametrize("attention", ["triton_grouped"])  # the grouped path covers the plain one's ops
def test_compiled_model_trains_like_eager(attention):
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    config = BertConfig.preset("tiny", vocab_size=256, num_hidden_layers=1)
    options = {"buckets": (8, 32)} if attention == "triton_grouped" else None
    eager = BertForPreTraining(config, attention=attention, attention_options=options).eval()  # no dropout
    compiled = BertForPreTraining(config, attention=attention, attention_options=options).eval()
    compiled.load_state_dict(eager.state_dict())

    torch._dynamo.reset()
    counters.clear()
    losses_eager = _train(eager, eager, BATCHES)
    losses_compiled = _train(compiled, torch.compile(compiled, backend="aot_eager"), BATCHES)

    torch.testing.assert_close(losses_compiled, losses_eager, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    breaks = dict(counters["graph_break"])
    assert not breaks, f"graph breaks: {breaks}"
    frames = counters["stats"]["unique_graphs"]
    assert 1 <= frames <= 2, f"{frames} graphs compiled for {len(BATCHES)} token counts (expected <= 2)"
