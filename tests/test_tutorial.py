"""Every command of docs/tutorial.md, run in order, so that the tutorial cannot rot.

Each part of the tutorial (``## Part N``) becomes one bash script, in the order the page
shows them: its ``bash`` blocks as they are, and each ``python`` block with a
``title="PATH"`` written to that path first (the page tells the reader to save it there).
The script runs from the repository's root with ``set -euo pipefail``, in a process group
of its own that is killed at the end whatever happened, and its output must show what the
page says it shows. The README's Python example runs in part 1 too, against the tutorial's
daemons, before they stop.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from vllm_env import vllm_python

#: The parts run daemons, then vLLM engines, past the suite's default of 180 s.
pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parent.parent
TUTORIAL = REPO / "docs" / "tutorial.md"
FENCE = re.compile(r'^```(\w+)(?: title="([^"]+)")?\n(.*?)^```$', re.S | re.M)
#: Any fence opening or closing, indented or not, with backticks or tildes.
ANY_FENCE = re.compile(r"^\s*(```|~~~)", re.M)


def part_script(number: int) -> str:
    """Part ``number``'s commands as one bash script."""
    text = TUTORIAL.read_text()
    start = text.index(f"\n## Part {number}:")
    end = text.find("\n## ", start + 1)
    lines = ["set -euo pipefail"]
    for language, title, body in FENCE.findall(text[start:end if end > 0 else None]):
        if language == "bash":
            lines.append(body.rstrip())
        elif language == "python" and title:
            lines += [f"cat > {title} <<'PYTHON'", body.rstrip(), "PYTHON"]
        else:
            raise AssertionError(f"a {language} block the test cannot run: give it a title=PATH")
    return "\n".join(lines) + "\n"


def with_readme_example(script: str) -> str:
    """``script`` with the README's Python example run before the daemons stop."""
    readme = (REPO / "README.md").read_text()
    example = FENCE.search(readme[readme.index("```python"):])
    assert example is not None and example.group(1) == "python"
    run = (f"cat > /tmp/kvxfer-tutorial/readme_example.py <<'PYTHON'\n{example.group(3).rstrip()}\nPYTHON\n"
           ".venv/bin/python /tmp/kvxfer-tutorial/readme_example.py\necho 'README example OK'\n")
    assert script.count("\nkill %1 %2\n") == 1
    return script.replace("\nkill %1 %2\n", f"\n{run}kill %1 %2\n")


def run_part(number: int, timeout_s: float, script: str = "") -> str:
    """Run part ``number`` (or ``script`` in its place); its output, or a failure with it."""
    process = subprocess.Popen(["bash", "-c", script or part_script(number)], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"part {number} still running after {timeout_s:.0f} s:\n{output[-6000:]}") from None
    finally:
        try:  # whatever the script left running (a daemon, an engine) goes with its group
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert process.returncode == 0, f"part {number} failed ({process.returncode}):\n{output[-6000:]}"
    return output


def test_every_block_of_the_tutorial_is_runnable() -> None:
    """A block the test would skip is a block that can rot: every fence of the page is one the
    parser reads (top level, a language, at most a title), every block is in a part, and
    the parts are the two the tests below run."""
    text = TUTORIAL.read_text()
    assert len(ANY_FENCE.findall(text)) == 2 * len(FENCE.findall(text))
    parts = re.findall(r"^## Part (\d+):", text, re.M)
    assert parts == ["1", "2"]
    assert text.index("```") > text.index("\n## Part 1:")
    assert "./scripts/demo.sh" in part_script(1) and "first_transfer.py" in part_script(1)
    assert "kvxfer vllm" in part_script(2)


@pytest.mark.slow
def test_part_1_a_first_transfer() -> None:
    output = run_part(1, timeout_s=300, script=with_readme_example(part_script(1)))
    assert "demo OK" in output and "README example OK" in output
    assert output.count("SERVING") == 2
    assert "moved 4194304 bytes in" in output and ": equal" in output
    assert "DONE" in output  # kvxfer transfers lists the tutorial's and the bench's transfers
    assert "ucx-tagged" in output  # kvxfer status shows the session's data plane
    # Stopped by the tutorial's kill, the daemons removed their sockets.
    assert not list(Path("/tmp/kvxfer-tutorial").glob("*.sock"))


@pytest.mark.slow
def test_part_2_disaggregated_vllm_behind_vllm_router() -> None:
    vllm_python()
    output = run_part(2, timeout_s=560)
    assert '"text_completion"' in output and '"completion_tokens":8' in output.replace(" ", "")
    assert "DONE" in output
