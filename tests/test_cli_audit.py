"""The command line as an operator meets it: what `serve` prints can be pasted, faults of the
data folder, the port and the environment are one clear line, `call` signs what it sends,
and two commands at once on one data folder do not undo each other's checks."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import FIXTURES, Service, free_port, tollgate

pytestmark = pytest.mark.server

ENV = {**os.environ, "TOLLGATE_SCHEDULES": "off", "PYTHONUNBUFFERED": "1"}
EVENT = {"semantic_kind": "activity", "event_type": "llm.completion",
         "occurred_at": "2026-11-01T12:00:00Z", "payload": {"usage": {"input_tokens": 1}}}


def cli(*args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = (),
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, sys.executable, "-m", "cli", *args], capture_output=True,
                          text=True, env=env or ENV, timeout=timeout)


def one_clear_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode != 0, r
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def serve(data_dir: Path, port: int, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", str(port),
                             "--data-dir", str(data_dir)], stdout=open(out, "wb"),
                            stderr=open(out.with_suffix(".err"), "wb"), env=ENV)


def wait_ready(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not become ready")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_call_the_first_start_prints_works_pasted_into_a_shell_without_the_venv(tmp_path: Path) -> None:
    data_dir = tmp_path / "my data"  # a folder name a shell would split
    port = free_port()
    proc = serve(data_dir, port, tmp_path / "serve.out")
    try:
        wait_ready(port, proc)
        banner = (tmp_path / "serve.out").read_text()
        lines = banner.splitlines()
        at = next(i for i, line in enumerate(lines) if "try it" in line)
        pasted = "\n".join(lines[at + 1:at + 3])
        # the README's set-up does not activate the venv: `tollgate` is not on PATH
        shell_env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
        r = subprocess.run(["bash", "-c", pasted], capture_output=True, text=True, env=shell_env,
                           cwd=tmp_path, timeout=60)
        assert r.stdout.splitlines()[:1] == ["HTTP 201"], (pasted, r.stdout, r.stderr)
        # the demo key is named by its id and where its secret is, never by the secret
        [(key_id, record)] = json.loads((data_dir / "keys.json").read_text()).items()
        output = banner + (tmp_path / "serve.err").read_text()
        assert key_id in banner and str(data_dir / "keys.json") in banner
        assert record["secret"] not in output
        assert record["secret"].rstrip("=") not in output
    finally:
        stop(proc)


def test_a_port_in_use_is_one_line_before_anything_is_set_up(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = cli("serve", "--port", str(port), "--data-dir", str(tmp_path / "d"))
    assert "in use" in one_clear_line(r)
    assert "serving on" not in r.stdout
    assert not (tmp_path / "d" / "keys.json").exists()


def test_a_data_dir_that_is_a_file_is_one_line_for_every_command(tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for args in (["serve", "--port", str(free_port())], ["keys", "create", "--realm", "acme"],
                 ["keys", "list"], ["keys", "disable", "tgk_x"],
                 ["catalog", "apply", str(FIXTURES / "catalog.toml")], ["call", "GET", "/healthz"]):
        r = cli(*args, "--data-dir", str(a_file))
        assert "not a folder" in one_clear_line(r), args


def test_a_data_dir_that_is_not_writable_is_one_line(tmp_path: Path) -> None:
    prefix: tuple[str, ...] = ()
    env = ENV
    if os.geteuid() == 0:  # root writes anywhere: run the commands as nobody
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv")
        prefix = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
        env = {**ENV, "HOME": "/tmp"}
    folder = Path(tempfile.mkdtemp())
    try:
        folder.chmod(0o555)
        for args in (["serve", "--port", str(free_port())], ["keys", "create", "--realm", "acme"],
                     ["catalog", "apply", str(FIXTURES / "catalog.toml")]):
            r = cli(*args, "--data-dir", str(folder), env=env, prefix=prefix)
            assert "ermission denied" in one_clear_line(r) or "not writable" in r.stderr, args
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)


def test_a_port_that_is_not_a_port_number_is_refused_in_one_line(tmp_path: Path) -> None:
    for command in (["keys", "list"], ["serve"], ["sql", "select 1"]):
        r = cli(*command, "--data-dir", str(tmp_path), env={**ENV, "TOLLGATE_PORT": "abc"})
        assert "TOLLGATE_PORT" in one_clear_line(r), command
    # 99999 used to wrap round to port 34463, and 0 to fall back to 8040
    for port in ("99999", "0", "-1"):
        r = cli("call", "GET", "/healthz", "--port", port, "--data-dir", str(tmp_path))
        assert r.returncode == 2 and "65535" in r.stderr, (port, r.stderr)


def test_call_sends_the_method_it_signs_and_refuses_a_path_without_a_slash(service: Service) -> None:
    body = json.dumps({**EVENT, "subject_ref": "cli-audit-lower-case-method"})
    r = tollgate("call", "post", "/mgt/v1/events", "--account", "acct_prepaid", "--data", body,
                 "--port", str(service.port), data_dir=service.data_dir, check=False)
    assert r.stdout.splitlines()[0] in ("HTTP 201", "HTTP 200"), r.stdout
    r = tollgate("call", "POST", "mgt/v1/events", "--port", str(service.port),
                 data_dir=service.data_dir, check=False)
    assert r.returncode == 2 and "must start with '/'" in one_clear_line(r)


def test_call_reads_data_from_a_file_or_standard_input_as_curl_does(service: Service,
                                                                     tmp_path: Path) -> None:
    body = tmp_path / "event.json"
    # Sent byte for byte (the signature covers the body): indentation and newline included.
    body.write_text(json.dumps({**EVENT, "subject_ref": "cli-audit-data-file"}, indent=2) + "\n")
    r = tollgate("call", "POST", "/mgt/v1/events", "--account", "acct_prepaid", "--data",
                 f"@{body}", "--port", str(service.port), data_dir=service.data_dir, check=False)
    assert r.stdout.splitlines()[0] in ("HTTP 201", "HTTP 200"), (r.stdout, r.stderr)
    assert '"cli-audit-data-file"' in r.stdout
    piped = subprocess.run(
        [sys.executable, "-m", "cli", "call", "POST", "/mgt/v1/events", "--account", "acct_prepaid",
         "--data", "@-", "--port", str(service.port), "--data-dir", str(service.data_dir)],
        input=json.dumps({**EVENT, "subject_ref": "cli-audit-data-stdin"}), capture_output=True,
        text=True, timeout=60)
    assert piped.stdout.splitlines()[0] in ("HTTP 201", "HTTP 200"), (piped.stdout, piped.stderr)
    assert '"cli-audit-data-stdin"' in piped.stdout
    missing = tmp_path / "nope.json"
    r = tollgate("call", "POST", "/mgt/v1/events", "--account", "acct_prepaid", "--data",
                 f"@{missing}", "--port", str(service.port), data_dir=service.data_dir, check=False)
    assert r.returncode == 2 and r.stdout == ""
    assert one_clear_line(r) == (f"tollgate: --data @{missing}: cannot read '{missing}':"
                                 " No such file or directory")


def test_call_with_a_realm_signs_with_a_key_of_that_realm(service: Service) -> None:
    tollgate("keys", "create", "--realm", "globex", data_dir=service.data_dir)
    body = json.dumps({**EVENT, "subject_ref": "cli-audit-realm"})
    deadline = time.monotonic() + 5
    while True:
        r = tollgate("call", "POST", "/mgt/v1/events", "--realm", "globex", "--account", "acct_globex",
                     "--data", body, "--port", str(service.port), data_dir=service.data_dir, check=False)
        status = r.stdout.splitlines()[0] if r.stdout else r.stderr
        if status != "HTTP 401" or time.monotonic() > deadline:  # the new key is read within 2 s
            break
        time.sleep(0.2)
    assert status in ("HTTP 201", "HTTP 200"), r.stdout


def test_two_catalog_applies_at_once_cannot_both_pass_the_grant_check(tmp_path: Path) -> None:
    changed = tmp_path / "changed.toml"
    changed.write_text((FIXTURES / "catalog.toml").read_text()
                       .replace('amount_xusd = "5000000"', 'amount_xusd = "9000000"'))
    procs = [subprocess.Popen([sys.executable, "-m", "cli", "catalog", "apply", str(f),
                               "--data-dir", str(tmp_path / "d")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=ENV)
             for f in (FIXTURES / "catalog.toml", changed)]
    codes = sorted(p.wait(timeout=120) for p in procs)
    assert codes == [0, 1], codes  # grant 'welcome-2026-11' is applied with one amount only


def test_two_services_started_at_once_on_a_fresh_folder(tmp_path: Path) -> None:
    data_dir = tmp_path / "d"
    ports = [free_port(), free_port()]
    procs = [serve(data_dir, port, tmp_path / f"serve{i}.out") for i, port in enumerate(ports)]
    try:
        deadline = time.monotonic() + 60
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        loser = next(i for i, p in enumerate(procs) if p.poll() is not None)
        err = (tmp_path / f"serve{loser}.err").read_text()
        assert procs[loser].returncode != 0 and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1 and "in use" in err, err
        winner = 1 - loser
        wait_ready(ports[winner], procs[winner])
        assert len(list((data_dir / "catalog" / "history").glob("*.toml"))) == 1  # applied once
    finally:
        for p in procs:
            stop(p)


def test_a_key_file_that_is_not_keys_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "keys.json").write_text("{not json")
    for args in (["keys", "list"], ["keys", "create", "--realm", "acme"], ["call", "GET", "/healthz"]):
        assert "not readable as keys" in one_clear_line(cli(*args, "--data-dir", str(tmp_path))), args
    assert (tmp_path / "keys.json").read_text() == "{not json"  # nothing written over it
