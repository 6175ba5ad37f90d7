"""Every ```python snippet in README.md runs verbatim.

Each snippet runs in a fresh interpreter: the kernel snippet sets
``TRITON_INTERPRET`` itself before importing tq_torch, which only works in a
process that has not imported triton yet, and a newcomer copies it into exactly
such a process. The test's own ``TRITON_INTERPRET`` is removed from the child's
environment so the snippet has to get that right by itself. Bash blocks are
documentation only and are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def python_blocks(markdown: str) -> list[str]:
    """The bodies of the fenced ```python blocks, in order."""
    return re.findall(r"^```python[ \t]*\n(.*?)^```[ \t]*$", markdown, flags=re.S | re.M)


SNIPPETS = python_blocks(open(README, encoding="utf-8").read())


def test_readme_has_python_snippets():
    # The kernel snippet (tq_torch and tq_jax) and the reference snippet at least.
    assert len(SNIPPETS) >= 2
    assert any("tq_torch." in s and "tq_jax." in s for s in SNIPPETS)


@pytest.mark.parametrize("index", range(len(SNIPPETS)), ids=lambda i: f"snippet{i + 1}")
def test_readme_snippet_runs(index, tmp_path):
    script = tmp_path / f"readme_snippet{index + 1}.py"
    script.write_text(SNIPPETS[index], encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    # Run from an empty directory, as a user would from anywhere once the project is installed.
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, f"README snippet {index + 1} failed:\n{SNIPPETS[index]}\n--- stderr ---\n{p.stderr[-4000:]}"
