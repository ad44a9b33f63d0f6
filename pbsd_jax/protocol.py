"""The agent protocol (Search-R1 compatible tags) and the prompt every stage shares.

An episode is a prompt followed by turns. Each turn the policy writes an action, e.g.
`<think>...</think><search>query</search>` or `<think>...</think><answer>text</answer>`; after
a search the environment appends one observation `<information>docs</information>`. Observation
text is written by the environment and never trained on; answers are only ever read from
action tokens.
"""

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
INFO_OPEN, INFO_CLOSE = "<information>", "</information>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

TAGS = (THINK_OPEN, THINK_CLOSE, SEARCH_OPEN, SEARCH_CLOSE, INFO_OPEN, INFO_CLOSE, ANSWER_OPEN,
        ANSWER_CLOSE)

# Generation of a turn stops after either closing tag (or EOS / the per-turn budget).
STOP_TAGS = (SEARCH_CLOSE, ANSWER_CLOSE)

# The embedded demo's prompt: short, because the tiny model learns the protocol in SFT.
DEFAULT_PROMPT_TEMPLATE = "Question: {question}\n"

# The Search-R1 instruction prompt, for pretrained models that must be told the protocol.
SEARCH_R1_PROMPT_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, "
    "you can call a search engine by <search> query </search> and it will return the top "
    "searched results between <information> and </information>. You can search as many times "
    "as your want. If you find no further external knowledge needed, you can directly provide "
    "the answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: {question}\n")


def format_prompt(question: str, template: str = DEFAULT_PROMPT_TEMPLATE) -> str:
  """The student prompt for `question` (the teacher's adds a privileged block to it)."""
  return template.format(question=question)

# The templates a run config can name (`config.data.prompt_template`).
PROMPT_TEMPLATES = {"default": DEFAULT_PROMPT_TEMPLATE, "search_r1": SEARCH_R1_PROMPT_TEMPLATE}
