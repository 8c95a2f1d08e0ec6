"""The README's Python example runs as it is written: the block is taken from README.md and
run as a script against the test service, with the address and key in the environment
variables it reads. Also: the README lists every subcommand of `tollgate --help`, and its list
of client methods tollgate answers matches the routes the client calls."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import Service

README = Path(__file__).parent.parent / "README.md"
MARKER = "<!-- the Python example: tests/test_readme_example.py runs this block as it is -->"


def python_example() -> str:
    text = README.read_text()
    after = text[text.index(MARKER) + len(MARKER):]
    found = re.match(r"\s*```python\n(.*?)\n```", after, flags=re.DOTALL)
    assert found, "no ```python block after the marker"
    return found.group(1)


def test_the_readme_python_example_runs_as_a_script(service: Service, tmp_path: Path) -> None:
    script = tmp_path / "gate_loop.py"
    script.write_text(python_example())
    env = {**os.environ, "TOLLGATE_URL": service.base_url, "TOLLGATE_KEY_ID": service.key.key_id,
           "TOLLGATE_KEY_SECRET": service.key.secret}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("authorized, lease "), done.stdout
    assert lines[1].startswith("committed, cost "), done.stdout
    assert lines[2] == "cancelled: True", done.stdout
    assert re.fullmatch(r"available -?[0-9]+ micro-USD", lines[3]), done.stdout
    assert all(line.startswith("quota of ") for line in lines[4:-1]), done.stdout
    assert re.fullmatch(r"event [0-9a-f-]{36}", lines[-1]), done.stdout


def test_the_readme_example_without_a_key_says_which_variable_is_missing(tmp_path: Path) -> None:
    script = tmp_path / "gate_loop.py"
    script.write_text(python_example())
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_KEY_")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 1 and "KeyError: 'TOLLGATE_KEY_ID'" in done.stderr, done.stderr


def test_the_commands_table_lists_every_subcommand() -> None:
    from tests.test_cli_help import SUBCOMMANDS

    table = README.read_text().split("## Commands", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `tollgate ([a-z]+)", table, flags=re.MULTILINE))
    assert listed >= set(SUBCOMMANDS), sorted(set(SUBCOMMANDS) - listed)


def test_the_client_methods_listed_are_those_tollgate_answers() -> None:
    """Each method listed calls, in the client, the route the README pairs it with, and the
    app declares that route with the method's operation id."""
    import inspect

    from vlunaai.service_client import ServiceClient

    text = README.read_text()
    table = text.split("The client methods tollgate answers", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| `([a-z_]+)` \| `(GET|POST) /mgt/v1(/\S*)` \|$", table, flags=re.MULTILINE)
    assert rows, table
    declared = declared_routes()
    for name, method, path in rows:
        source = inspect.getsource(getattr(ServiceClient, name))
        assert f"path='{path}', method='{method}'" in source, (name, source)
        assert declared.get(name) == (method, "/mgt/v1" + path), (name, declared)


def declared_routes() -> dict[str, tuple[str, str]]:
    """The app's routes by operation id, as its OpenAPI document declares them."""
    from api.openapi import ROUTES

    return {route.operation_id: (route.method, route.path) for route in ROUTES}
