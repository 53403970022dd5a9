"""A user's own Flax NNX model in the stageable form trains through h2jax.train (the README example)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import h2jax
from h2jax.runtime import Trainer, flatten
from tests.runtime.user_model_job import WIDTH, Block, Embed, MyModel


# the README's own-model example (its classes live in the job script that mpirun runs too)
class TiedHead(nnx.Module):
    """GPT-2 style: the head reuses the embedding table."""

    def __init__(self, embed):
        self.embed = embed

    def __call__(self, h, targets):
        logits = (h @ self.embed.table[...].T).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


class TiedModel(nnx.Module):
    def __init__(self, rngs):
        self.embed = Embed(rngs)
        self.head = TiedHead(self.embed)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])


OVERRIDES = [
    "model.n_layers=4",
    "model.seq_len=32",
    "train.steps=20",
    "train.progress=false",
    "train.tensorboard=false",
    "plan.stages.0.layers=[0,3]",
    "plan.stages.1.layers=[3,4]",
]


def test_readme_user_model_trains_and_comes_back(tmp_path):
    """The model's width is not repeated in model.* (its d_model stays 128); the trained parameters
    come back in the module passed in."""
    cfg = h2jax.load_config(None, OVERRIDES)
    h2jax.setup_backends(cfg.cluster)
    model = MyModel(nnx.Rngs(0))
    before = {k: np.asarray(v) for k, v in flatten(nnx.state(model, nnx.Param)).items()}
    result = h2jax.train(cfg, model=model, run_dir=tmp_path)
    history = result.history
    assert len(history) == 20
    assert all(math.isfinite(h.loss) for h in history)
    assert history[-1].loss < history[0].loss - 0.5, [h.loss for h in history]
    assert (tmp_path / "trace.json").is_file() and (tmp_path / "gantt.png").is_file()
    assert result.model is model and result.summary["last_loss"] == history[-1].loss
    after = {k: np.asarray(v) for k, v in flatten(nnx.state(model, nnx.Param)).items()}
    assert sorted(after) == sorted(before)
    assert all(not np.array_equal(after[k], before[k]) for k in after), "every parameter was trained"
    # the final checkpoint (what a resumed run continues from) holds exactly these parameters
    other = Trainer(cfg, model=MyModel(nnx.Rngs(1)), run_dir=tmp_path)
    assert "step 20" in other.resume()
    final = {k: np.asarray(v) for k, v in other.gathered_params().items()}
    other.close()
    assert sorted(final) == sorted(after)
    for k in after:
        np.testing.assert_array_equal(after[k], final[k], err_msg=k)


def test_a_parameter_two_stages_share_trains_as_one(tmp_path):
    """The user's GPT-2 style model (head tied to the embedding) split so that stage 0 and
    stage 1 both use the table trains as the one-stage run does, and both copies stay equal."""
    over = [*OVERRIDES, "model.n_layers=2", "train.steps=3"]
    split = h2jax.load_config(None, [*over, "plan.stages.0.layers=[0,1]", "plan.stages.1.layers=[1,2]"])
    one = h2jax.load_config(None, [*over, "plan.stages=[{chip: sim_a, data: 2, tensor: 1, layers: [0, 2]}]"])
    a = h2jax.train(split, model=TiedModel(nnx.Rngs(0)), run_dir=tmp_path / "split")
    b = h2jax.train(one, model=TiedModel(nnx.Rngs(0)), run_dir=tmp_path / "one")
    np.testing.assert_allclose([h.loss for h in a.history], [h.loss for h in b.history], rtol=0, atol=1e-5)
    assert a.model.head.embed is a.model.embed  # the tie itself survives training
    np.testing.assert_allclose(np.asarray(a.model.embed.table[...]), np.asarray(b.model.embed.table[...]), atol=1e-5)


def test_a_shared_parameter_trains_on_one_stage(tmp_path):
    one = "[{chip: sim_a, data: 2, tensor: 1, layers: [0, 2]}]"
    cfg = h2jax.load_config(None, [*OVERRIDES, "model.n_layers=2", f"plan.stages={one}", "train.steps=5"])
    result = h2jax.train(cfg, model=TiedModel(nnx.Rngs(0)), run_dir=tmp_path)
    assert len(result.history) == 5 and result.history[-1].loss < result.history[0].loss


def test_non_stageable_model_is_refused(tmp_path):
    class NoHead(nnx.Module):
        def __init__(self, rngs):
            self.embed = Embed(rngs)
            self.blocks = nnx.List([Block(rngs)])

    cfg = h2jax.load_config(None, ["train.progress=false"])
    with pytest.raises(TypeError, match="head"):
        h2jax.train(cfg, model=NoHead(nnx.Rngs(0)), run_dir=tmp_path)


def test_a_model_with_batch_statistics_is_refused_in_one_line(tmp_path):
    cfg = h2jax.load_config(None, OVERRIDES)
    model = MyModel(nnx.Rngs(0))
    model.norm = nnx.BatchNorm(8, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError) as e:
        h2jax.train(cfg, model=model, run_dir=tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "non-Param state norm/mean" in msg, msg


class PerTokenHead(nnx.Module):
    """A head that forgot the mean: a loss per token."""

    def __init__(self, rngs):
        self.out = nnx.Linear(WIDTH, 256, use_bias=False, rngs=rngs)

    def __call__(self, h, targets):
        return optax.softmax_cross_entropy_with_integer_labels(self.out(h).astype(jnp.float32), targets)


class DropoutBlock(Block):
    def __init__(self, rngs):
        super().__init__(rngs)
        self.drop = nnx.Dropout(0.1)  # no rngs: it cannot draw a mask

    def __call__(self, h):
        return self.drop(super().__call__(h))


def test_a_model_that_cannot_run_is_refused_before_the_first_step(tmp_path):
    """A per-token loss and an nnx.Dropout without rngs: one line naming the part and the fix,
    before any stage is built (not JAX's VJP message in step 0's backward, not flax's own)."""
    cfg = h2jax.load_config(None, OVERRIDES)
    model = MyModel(nnx.Rngs(0))
    model.head = PerTokenHead(nnx.Rngs(1))
    with pytest.raises(TypeError) as e:
        h2jax.train(cfg, model=model, run_dir=tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "MyModel.head(h, targets) returned shape (1, 32)" in msg and ".mean()" in msg, msg
    model = MyModel(nnx.Rngs(0))
    model.blocks[2] = DropoutBlock(nnx.Rngs(2))
    with pytest.raises(TypeError) as e:
        h2jax.train(cfg, model=model, run_dir=tmp_path)
    msg = str(e.value)
    assert "MyModel.blocks.2.drop is an nnx.Dropout without rngs" in msg and "h2jax.models.Dropout" in msg, msg
    assert not any(tmp_path.iterdir())  # refused before the run folder was written
