"""Fuzz of the token-level action rules: arbitrary action token strings (unclosed, nested or
repeated tags, empty or over-long queries) never break the rollout and never make an
environment-written token an action."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pbsd_jax.agent.env.agent_env import AgentEnv
from pbsd_jax.agent.env.bm25 import BM25Index
from pbsd_jax.agent.rollout import ingraph_rollout
from pbsd_jax.generate.sampling import Sampler
from pbsd_jax.models import ModelConfig, init_params

V, TURNS, WIDTH = 40, 3, 10
TAGS = dict(search_open=5, search_close=6, answer_open=9, answer_close=10, info_open=7,
            info_close=8)
ENV = AgentEnv(buffer_size=80, max_turns=TURNS, max_action_tokens=WIDTH,
               max_observation_tokens=12, max_query_tokens=4, top_k=2, eos_id=1,
               notice=(30, 31), **TAGS)
DOCS = [list(np.random.default_rng(i).integers(11, V, size=3 + i % 4)) for i in range(8)]
INDEX = BM25Index.build(DOCS, V, ignore_ids=range(11))
CONFIG = ModelConfig(vocab_size=V, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                     mlp_dim=32)
PARAMS = init_params(CONFIG, jax.random.key(0))
SAMPLER = Sampler(CONFIG)
PROMPT, PMASK = jnp.array([[0, 12, 13, 14]] * 2), jnp.array([[False, True, True, True]] * 2)
GOLD = jnp.full((2, 1, 2), 13, jnp.int32)

token = st.one_of(st.sampled_from([1, 5, 6, 7, 8, 9, 10]), st.integers(11, V - 1))
action = st.lists(token, min_size=1, max_size=WIDTH)
episode = st.lists(action, min_size=1, max_size=TURNS)


@settings(max_examples=40, deadline=None)
@given(st.lists(episode, min_size=2, max_size=2))
def test_arbitrary_actions_never_mark_environment_tokens_as_actions(episodes):
  forced = np.zeros((TURNS, 2, WIDTH), np.int32)
  lengths = np.zeros((TURNS, 2), np.int32)
  for b, actions in enumerate(episodes):
    for k, ids in enumerate(actions):
      forced[k, b, :len(ids)], lengths[k, b] = ids, len(ids)
  out = ingraph_rollout(SAMPLER, ENV, PARAMS, PROMPT, PMASK, jax.random.key(0), INDEX, GOLD,
                        None, jnp.asarray(forced), jnp.asarray(lengths))
  tokens, action = np.asarray(out.tokens), np.asarray(out.action_mask)
  np.testing.assert_array_equal(action, np.asarray(out.turn_ids) >= 0)
  for b, actions in enumerate(episodes):
    taken = int(out.num_turns[b])
    assert 1 <= taken <= min(len(actions), TURNS) or (taken == TURNS)
    # The action tokens are exactly the forced actions of the turns taken, in order (the last
    # one possibly cut by the context budget).
    want = [t for ids in actions[:taken] for t in ids]
    got = tokens[b][action[b]].tolist()
    assert got == want[:len(got)] and (len(got) == len(want) or bool(out.truncated[b]))
    # Everything else after the prompt is the environment's: documents or the notice, with
    # no action-protocol tag ever inside.
    env_tokens = tokens[b, 4:int(out.length[b])][~action[b, 4:int(out.length[b])]]
    assert not np.isin(env_tokens, [5, 6, 9, 10]).any()
    assert bool(out.finished[b]) != bool(out.truncated[b]) or taken < len(actions)
