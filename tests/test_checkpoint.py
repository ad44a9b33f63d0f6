"""Checkpoints: exact round trip, target shardings, half-written steps, retention, SIGTERM,
checksums and the fall-back past corrupt steps."""

import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import multiprocess_worker as mw
from pbsd_jax.parallel import sharding
from pbsd_jax.rl import train_state
from pbsd_jax.run.checkpoint import Checkpointer, ConfigMismatchError, PreemptionGuard, checksums

DATA_STATE = {"epoch": 1, "position": 17, "seed": 3, "split": "train"}


@pytest.fixture(scope="module")
def state():
  """A state with a non-trivial optimiser state, step and key (one update applied)."""
  tx = mw.make_tx()
  start = mw.initial_state(tx)

  @jax.jit
  def one_update(s):
    grads = jax.tree.map(lambda p: 0.01 * jnp.cos(p), s.params)
    updates, opt_state = tx.update(grads, s.opt_state, s.params)
    return s.replace(params=optax.apply_updates(s.params, updates), opt_state=opt_state,
                     step=jnp.int32(7), rng=jax.random.key(42))

  return one_update(start)


def _assert_states_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a.replace(rng=None)), jax.tree.leaves(b.replace(rng=None))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert a.rng.dtype == b.rng.dtype
  np.testing.assert_array_equal(jax.random.key_data(a.rng), jax.random.key_data(b.rng))


def _at(state, step):
  return state.replace(step=jnp.int32(step))


def test_round_trip_restores_state_and_data_state_exactly(tmp_path, state):
  with Checkpointer(str(tmp_path)) as ckpt:
    assert ckpt.save(state, DATA_STATE)
    ckpt.wait()
  with Checkpointer(str(tmp_path)) as ckpt:
    assert ckpt.latest_step() == 7
    restored, data_state = ckpt.restore(mw.initial_state(mw.make_tx()))
  _assert_states_equal(restored, state)
  assert int(restored.step) == 7
  assert data_state == DATA_STATE
  # The restored key continues the same random stream.
  np.testing.assert_array_equal(jax.random.uniform(restored.rng, (3,)),
                                jax.random.uniform(state.rng, (3,)))


def test_restore_places_arrays_in_the_target_shardings(tmp_path, state):
  with Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(state, DATA_STATE)
  tx, mesh = mw.make_tx(), sharding.make_mesh(2, 2, 2)
  shardings = train_state.train_state_shardings(mw.make_config(), tx, mesh)
  target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state, shardings)
  with Checkpointer(str(tmp_path)) as ckpt:
    restored, _ = ckpt.restore(target)
  gate = restored.params["layers"]["mlp"]["gate_kernel"]
  assert gate.sharding == shardings.params["layers"]["mlp"]["gate_kernel"]
  assert {s.data.shape for s in gate.addressable_shards} == {(1, 16, 32)}
  _assert_states_equal(jax.device_get(restored), jax.device_get(state))


def test_half_written_checkpoint_is_skipped_for_the_previous_one(tmp_path, state):
  with Checkpointer(str(tmp_path), async_save=False) as ckpt:
    ckpt.save(_at(state, 1), {"position": 1})
    ckpt.save(_at(state, 2), {"position": 2})
  # What a kill during the save of step 3 leaves: orbax's temporary directory, never renamed.
  partial = tmp_path / "3.orbax-checkpoint-tmp-1700000000000000"
  shutil.copytree(tmp_path / "2", partial)
  with Checkpointer(str(tmp_path)) as ckpt:
    assert ckpt.latest_step() == 2
    restored, data_state = ckpt.restore(state)
    assert int(restored.step) == 2 and data_state == {"position": 2}
    assert ckpt.save(_at(state, 3), {"position": 3})  # the run goes on and saves step 3
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2, 3]


def test_max_to_keep_keeps_the_newest_checkpoints(tmp_path, state):
  with Checkpointer(str(tmp_path), max_to_keep=2) as ckpt:
    for step in range(1, 6):
      ckpt.save(_at(state, step))
    ckpt.wait()
    assert ckpt.all_steps() == [4, 5]
  assert sorted(p for p in os.listdir(tmp_path) if p.isdigit()) == ["4", "5"]


def test_save_interval_skips_off_interval_steps_unless_forced(tmp_path, state):
  with Checkpointer(str(tmp_path), save_interval_steps=2, max_to_keep=None) as ckpt:
    saved = [ckpt.save(_at(state, step)) for step in range(1, 6)]
    # Step 1 is the first save into an empty directory, which orbax always writes.
    assert saved == [True, True, False, True, False]
    assert ckpt.save(_at(state, 5), force=True)
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2, 4, 5]


def test_a_saved_step_is_not_rewritten(tmp_path, state):
  with Checkpointer(str(tmp_path)) as ckpt:
    assert ckpt.save(_at(state, 4), {"position": 4})
    assert not ckpt.save(_at(state, 4), {"position": 999}, force=True)
    ckpt.wait()
    assert ckpt.restore(state)[1] == {"position": 4}


def test_empty_directory_restores_nothing(tmp_path, state):
  with Checkpointer(str(tmp_path)) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.restore_latest(state) is None
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
      ckpt.restore(state)


def test_sigterm_triggers_a_final_save(tmp_path, state):
  previous = signal.getsignal(signal.SIGTERM)
  with Checkpointer(str(tmp_path), save_interval_steps=100) as ckpt:
    with PreemptionGuard() as guard:
      assert not guard.save_if_requested(ckpt, state, DATA_STATE)
      os.kill(os.getpid(), signal.SIGTERM)
      assert guard.requested
      assert guard.save_if_requested(ckpt, state, DATA_STATE)  # 7 is off the interval
    assert ckpt.latest_step() == 7
    assert ckpt.restore(state)[1] == DATA_STATE
  assert signal.getsignal(signal.SIGTERM) is previous


def test_bad_settings_name_the_field(tmp_path):
  with pytest.raises(ValueError, match="max_to_keep"):
    Checkpointer(str(tmp_path), max_to_keep=0)
  with pytest.raises(ValueError, match="save_interval_steps"):
    Checkpointer(str(tmp_path), save_interval_steps=0)


def largest_file(directory):
  """The largest file under `directory` (an array chunk of orbax's OCDBT store)."""
  files = [os.path.join(d, f) for d, _, names in os.walk(directory) for f in names]
  return max(files, key=os.path.getsize)


def flip_bytes(path, count=64):
  """Inverts `count` bytes in the middle of `path`, its size unchanged."""
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    start = len(data) // 2 - count // 2
    data[start:start + count] = bytes(b ^ 0xFF for b in data[start:start + count])
    f.seek(0)
    f.write(data)


def truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def delete_manifest(step_dir):
  os.remove(os.path.join(step_dir, "state", "manifest.ocdbt"))


def test_a_checksum_changes_when_any_one_element_changes():
  x = jnp.arange(24, dtype=jnp.float32).reshape(2, 3, 4)
  base = checksums({"x": x})["['x']"]
  assert checksums({"x": x.at[1, 2, 3].add(1e-6)})["['x']"] != base
  # Moving values between positions changes it too (the multiplier depends on the position).
  assert checksums({"x": x.at[0, 0, 1].set(x[0, 0, 2]).at[0, 0, 2].set(x[0, 0, 1])}
                   )["['x']"] != base
  assert checksums({"b": jnp.zeros(3, jnp.bfloat16)})["['b']"] == 0


def test_a_sharded_array_has_the_checksum_of_its_host_copy(state):
  tx, mesh = mw.make_tx(), sharding.make_mesh(2, 2, 2)
  shardings = train_state.train_state_shardings(mw.make_config(), tx, mesh)
  placed = jax.device_put(state.params, shardings.params)
  assert checksums(placed) == checksums(jax.device_get(state.params))


def _two_steps(directory, state):
  with Checkpointer(directory, async_save=False) as ckpt:
    ckpt.save(_at(state, 1), {"position": 1})
    ckpt.save(_at(state, 2).replace(params=jax.tree.map(lambda p: p + 1, state.params)),
              {"position": 2})


@pytest.mark.parametrize("corrupt", [
    lambda step_dir: flip_bytes(largest_file(os.path.join(step_dir, "state"))),
    lambda step_dir: truncate(largest_file(os.path.join(step_dir, "state"))),
    delete_manifest,
], ids=["flipped_bytes", "truncated", "deleted_manifest"])
def test_a_corrupt_latest_step_falls_back_to_the_previous_one(tmp_path, state, corrupt):
  _two_steps(str(tmp_path), state)
  corrupt(str(tmp_path / "2"))
  lines = []
  with Checkpointer(str(tmp_path)) as ckpt:
    restored, data_state = ckpt.restore_latest(state, report=lines.append)
    assert int(restored.step) == 1 and data_state == {"position": 1}
    _assert_states_equal(restored, _at(state, 1))
    assert len(lines) == 1 and "checkpoint 2" in lines[0], lines
    assert ckpt.all_steps() == [1]  # set aside, so step 2 is saved anew
    assert ckpt.save(_at(state, 2), {"position": 2})
    ckpt.wait()
    assert ckpt.restore(state)[1] == {"position": 2}
  assert len(os.listdir(tmp_path / "unusable")) == 1


def test_arrays_that_read_back_with_other_values_are_caught_by_the_checksum(tmp_path, state):
  _two_steps(str(tmp_path / "run"), state)
  # Step 2's array files replaced by valid ones holding other values: orbax reads them
  # without error, as it reads bytes flipped where no format check looks.
  with Checkpointer(str(tmp_path / "other"), async_save=False) as other:
    other.save(_at(state, 2).replace(params=jax.tree.map(lambda p: p * 0.5, state.params)))
  shutil.rmtree(tmp_path / "run" / "2" / "state")
  shutil.copytree(tmp_path / "other" / "2" / "state", tmp_path / "run" / "2" / "state")
  lines = []
  with Checkpointer(str(tmp_path / "run")) as ckpt:
    restored, _ = ckpt.restore_latest(state, report=lines.append)
  assert int(restored.step) == 1
  assert len(lines) == 1 and "checksum mismatch" in lines[0], lines


def test_no_good_step_is_a_fresh_start_said_in_one_line(tmp_path, state):
  _two_steps(str(tmp_path), state)
  for step in ("1", "2"):
    delete_manifest(str(tmp_path / step))
  lines = []
  with Checkpointer(str(tmp_path)) as ckpt:
    assert ckpt.restore_latest(state, report=lines.append) is None
  assert len(lines) == 3 and "no good checkpoint" in lines[-1], lines


def test_a_step_of_another_configuration_is_refused(tmp_path, state):
  with Checkpointer(str(tmp_path), fingerprint="aaa") as ckpt:
    ckpt.save(state, DATA_STATE)
  with Checkpointer(str(tmp_path), fingerprint="bbb") as ckpt:
    with pytest.raises(ConfigMismatchError, match="another configuration"):
      ckpt.restore_latest(state)
    restored, _ = ckpt.restore_latest(state, check_fingerprint=False)
  _assert_states_equal(restored, state)
