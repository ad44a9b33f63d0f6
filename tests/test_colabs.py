"""The notebooks of colabs/ run top to bottom in a real Jupyter kernel (nbclient), with the
small sizes each takes as parameters; a cell that raises fails the test. A cell appended after
the last one prints what each test checks, computed in the notebook's own kernel state."""

import html
import json
import os

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from script_env import script_env
from test_train import ROOT

COLABS = os.path.join(ROOT, "colabs")
NOTEBOOKS = ("quickstart", "credit", "hf_model", "mesh", "results")
MARK = "CHECKS:"
# The test SFT runs are far too short to earn a reward: the micro model at the test sizes.
MICRO = {"model.name": "micro", "sft.steps": 20, "sft.batch_size": 8, "sft.max_examples": 64,
         "sft.schedule": "constant", "rollout.prompts_per_step": 2, "grpo.group_size": 2,
         "eval.every": 0, "checkpoint.async_save": False}


def execute_notebook(name, params, checks=None):
  """Runs `colabs/<name>.ipynb` with `params` (code) after its `parameters` cell and
  `checks` (an expression) printed as JSON at the end; returns `(notebook, checks)`."""
  nb = nbformat.read(os.path.join(COLABS, f"{name}.ipynb"), as_version=4)
  at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
  nb.cells.insert(at + 1, nbformat.v4.new_code_cell(params))
  if checks:
    nb.cells.append(nbformat.v4.new_code_cell(
        f"import json as _json\nprint({MARK!r} + _json.dumps({checks}, default=float))"))
  client = NotebookClient(nb, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": COLABS}})
  client.execute(env=script_env(TF_CPP_MIN_LOG_LEVEL="3"))
  if not checks:
    return nb, None
  out = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
  return nb, json.loads(out.split(MARK, 1)[1])


def _html(nb):
  return "".join(o["data"]["text/html"] for c in nb.cells if c.cell_type == "code"
                 for o in c.outputs if "text/html" in o.get("data", {}))


def _data_dir(kg):
  return os.path.dirname(kg.paths["spm_model"])


def test_every_notebook_is_stored_without_outputs_and_opens_with_the_setup_cell():
  for name in NOTEBOOKS:
    nb = nbformat.read(os.path.join(COLABS, f"{name}.ipynb"), as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), name
    assert "google.colab" in code[0].source and "one_line_errors" in code[0].source, name
    assert sum("parameters" in c.metadata.get("tags", []) for c in code) == 1, name


def test_quickstart_trains_rolls_out_and_takes_a_pbsd_step(kg, tmp_path):
  nb, got = execute_notebook(
      "quickstart", f"WORKDIR = {str(tmp_path)!r}; DATA_DIR = {_data_dir(kg)!r}; "
      f"OVERRIDES = {{**{MICRO!r}, 'rl.steps': 1}}",
      "dict(actions=action_tokens, observations=observation_tokens, sft=[sft_rows[0]['loss'], "
      "sft_rows[-1]['loss']], row=pbsd_row, chain=question['chain_names'])")
  assert got["actions"] > 0 and got["observations"] > 0  # the agent searched and was answered
  assert got["sft"][1] < got["sft"][0] - 1.0
  assert got["row"]["step"] == 1 and np.isfinite(got["row"]["loss"])
  assert got["row"]["credit/mean_abs_evidence"] > 0
  page = _html(nb)
  assert "class='act'" in page and "class='obs'" in page
  text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
  assert " -> ".join(got["chain"]) in text


def test_credit_weights_follow_the_formula_and_respond_to_delta(kg, tmp_path):
  """Groups of 2 samples and 2 oracle replays: mixed outcomes, so the weights are not 1."""
  overrides = {**MICRO, "grpo.group_size": 4}
  checks = ("dict(delta=DELTA, clip=CLIP, rows=[dict(a=v.advantage, s=v.filtered.tolist(), "
            "w=v.weights.tolist(), turns=[k for k, _ in v.segments if k >= 0]) "
            "for v in credit_at(DELTA, CLIP, EPS_POS, EPS_NEG)[2]], "
            "wide=float(max(abs(w - 1) for v in credit_at(DELTA * 100, CLIP, EPS_POS, EPS_NEG)[2]"
            " for w in v.weights)), summary=summary, reward=reward.tolist())")
  nb, got = execute_notebook(
      "credit", f"WORKDIR = {str(tmp_path)!r}; DATA_DIR = {_data_dir(kg)!r}; "
      f"OVERRIDES = {overrides!r}; QUESTIONS, ORACLE_ROWS = 3, 2", checks)
  reward = np.asarray(got["reward"]).reshape(3, 4)
  assert np.all(reward[:, 2:] == 1)  # the oracle rows solve their questions
  c, delta = got["clip"], got["delta"]
  deviations = []
  for row in got["rows"]:
    s, w = np.asarray(row["s"]), np.asarray(row["w"])
    np.testing.assert_allclose(w, 1 + c * np.tanh(np.sign(row["a"]) * s / delta), atol=1e-6)
    assert np.all((w >= 1 - c - 1e-6) & (w <= 1 + c + 1e-6))
    deviations += [abs(w[k] - 1) for k in row["turns"]]
  assert max(deviations) > 0.01  # the mixed groups' weights really move
  assert got["wide"] < max(deviations)  # a larger delta pulls every weight towards 1
  assert got["summary"]["labelled_turns"] > 0
  assert "Teacher prompt (privileged)" in _html(nb)


def test_a_missing_checkpoint_is_one_line_in_the_cell(tmp_path):
  missing = str(tmp_path / "no_such_ckpt")
  with pytest.raises(CellExecutionError) as err:
    execute_notebook("credit", f"WORKDIR = {str(tmp_path)!r}; CKPT_DIR = {missing!r}")
  assert err.value.ename == "NotebookError"
  assert missing in err.value.evalue
  assert "Traceback" not in str(err.value) and "jax" not in err.value.evalue


def test_hf_model_converts_a_transformers_checkpoint_and_searches_with_it(tmp_path):
  nb, got = execute_notebook(
      "hf_model", f"WORKDIR = {str(tmp_path)!r}; SFT_STEPS, RL_STEPS = 60, 2",
      "dict(searches=np.asarray(rollout.searches).tolist(), steps=[r['step'] for r in rl_rows],"
      " tags={t: len(task.tokenizer.encode(t)) for t in protocol.TAGS}, obs=int(np.sum("
      "rollout.observation_mask)), docs=[text for _, text in DOCUMENTS])")
  assert got["steps"] == [1, 2]
  assert sum(got["searches"]) > 0 and got["obs"] > 0
  assert all(n > 1 for n in got["tags"].values())
  text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
  assert "<|im_start|>assistant" in text
  page = _html(nb)  # an observation came back from the retriever: a corpus document
  assert "<span class='obs' title='observation'>&lt;information&gt;" in page
  assert any(html.escape(doc) in page for doc in got["docs"])


def test_mesh_step_on_8_devices_equals_one_device(kg, tmp_path):
  _, got = execute_notebook(
      "mesh", f"WORKDIR = {str(tmp_path)!r}; DATA_DIR = {_data_dir(kg)!r}; "
      "OVERRIDES = {**OVERRIDES, 'checkpoint.async_save': False}",
      "dict(devices=len(devices), moved=moved, differ=differ, mesh=dict(mesh.shape), "
      "same=[mesh_metrics[k] == one_metrics[k] for k in ('mean_turns', 'searches')])")
  assert got["devices"] == 8 and got["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
  assert got["moved"] > 1e-5  # a real update
  assert got["differ"] < 2e-6 and all(got["same"])  # float rounding only (test_multihost)


def test_results_without_runs_makes_a_comparison_and_reports_its_failure_in_one_line(
    tmp_path):
  """With no runs the notebook starts compare.py (its drawing of a finished comparison is
  tested beside compare.py, tests/test_compare.py); a flag compare.py rejects is one line."""
  with pytest.raises(CellExecutionError) as err:
    execute_notebook("results", f"RUNS_DIR = {str(tmp_path / 'none')!r}; "
                     f"WORKDIR = {str(tmp_path)!r}; SMALL = ['--config.sft.stpes=4']")
  assert err.value.ename == "NotebookError"
  assert "compare.py: " in err.value.evalue and "config.sft.steps" in err.value.evalue


def test_load_config_names_an_unknown_field_and_a_bad_value():
  from pbsd_jax.run import notebook
  from pbsd_jax.run.run_config import ConfigError
  config = notebook.load_config("demo", {"sft.steps": 70, "pbsd.delta": 0.5})
  assert (config.sft.steps, config.pbsd.delta, config.algorithm) == (70, 0.5, "pbsd")
  with pytest.raises(notebook.NotebookError, match=r"config\.sft\.stpes: .*config\.sft\.steps"):
    notebook.load_config("demo", {"sft.stpes": 7})
  with pytest.raises(ConfigError, match=r"config\.sft\.steps"):
    notebook.load_config("demo", {"sft.steps": -1})
  with pytest.raises(notebook.NotebookError, match="no such config file"):
    notebook.load_config("no_such_config")
