"""The package tree shows the architecture: every import goes down the layers."""

import ast
import pathlib

import pbsd_jax

# Bottom to top; a module may import its own layer and the layers below it.
LAYERS = (("protocol", "parallel"), ("models",), ("generate",), ("data",), ("agent",),
          ("rl",), ("eval",), ("run",))
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
ROOT = pathlib.Path(pbsd_jax.__file__).parent


def _imports(path: pathlib.Path):
  """`(line, 'pbsd_jax.x.y')` of every pbsd_jax import in a module, at any depth."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pbsd_jax"):
      if node.module == "pbsd_jax":
        yield from ((node.lineno, f"pbsd_jax.{a.name}") for a in node.names)
      else:
        yield node.lineno, node.module
    elif isinstance(node, ast.Import):
      yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("pbsd_jax."))


def _layer(dotted: str) -> str:
  return dotted.split(".")[1]


def test_every_module_belongs_to_a_layer():
  top = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
         if p.name != "__pycache__" and p.name != "__init__.py"}
  assert top == set(RANK)


def test_imports_only_go_down():
  upward = []
  for path in sorted(ROOT.rglob("*.py")):
    module = "pbsd_jax." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if module.endswith(".__init__") and module.count(".") == 1:
      continue
    own = RANK[_layer(module)]
    for line, target in _imports(path):
      if RANK[_layer(target)] > own:
        upward.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target}")
  assert not upward, "\n".join(upward)
