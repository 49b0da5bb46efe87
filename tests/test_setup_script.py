"""scripts/setup.sh's virtualenv step, run on a copy of the script with fake commands (a
Python whose venv lacks pip, Java, Maven, Redis): a venv that cannot run pip is made again,
and a venv that could not be made is removed so that the next run makes it again."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.stack import ROOT

# The venv's python: pip runs in it, or (PIP=no) it is missing, as after a failed ensurepip.
_VENV_PYTHON = """#!/bin/sh
if [ "$1 $2" = "-m pip" ]; then
    [ "$PIP" = yes ] || { echo "No module named pip" >&2; exit 1; }
fi
exit 0
"""

# python3.11 and python3: `-m venv DIR` writes the venv's python, then fails (as in
# ensurepip) unless PIP=yes; anything else (the version checks) succeeds.
_PYTHON = f"""#!/bin/sh
if [ "$1 $2" = "-m venv" ]; then
    echo venv >> "$CALLS"
    mkdir -p "$3/bin"
    cat > "$3/bin/python" <<'EOF'
{_VENV_PYTHON}EOF
    chmod +x "$3/bin/python"
    [ "$PIP" = yes ] || {{ echo "ensurepip failed" >&2; exit 1; }}
fi
[ "$1" = --version ] && echo "Python 3.11.9"
exit 0
"""

_FAKES = {
    "python3.11": _PYTHON,
    "python3": _PYTHON,
    "java": "#!/bin/sh\necho '    java.specification.version = 17' >&2\n",
    "mvn": "#!/bin/sh\n",
    "redis-server": "#!/bin/sh\n",
}


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the script in a directory of its own, fakes on the PATH."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    for name, text in _FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return tmp_path


def _setup(checkout: Path, *, pip: bool) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": f"{checkout / 'fake-bin'}:/usr/bin:/bin",
        "HOME": str(checkout),
        "PIP": "yes" if pip else "no",
        "CALLS": str(checkout / "calls"),
    }
    return subprocess.run(
        ["bash", str(checkout / "scripts" / "setup.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_venv_without_pip_is_made_again_and_removed_when_that_fails(checkout: Path) -> None:
    # Left by a run whose ensurepip failed: its python runs, pip does not.
    venv_python = checkout / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text(_VENV_PYTHON)
    venv_python.chmod(0o755)

    failed = _setup(checkout, pip=False)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "could not create .venv with pip in it" in failed.stderr
    assert (checkout / "calls").read_text().split() == ["venv"]
    assert not (checkout / ".venv").exists()  # the next run makes it afresh

    fixed = _setup(checkout, pip=True)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "setup: ready" in fixed.stdout
    assert (checkout / "calls").read_text().split() == ["venv", "venv"]
    assert os.access(venv_python, os.X_OK)

    again = _setup(checkout, pip=True)  # a usable venv is kept
    assert again.returncode == 0, again.stdout + again.stderr
    assert (checkout / "calls").read_text().split() == ["venv", "venv"]
