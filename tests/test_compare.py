"""benchmarks/compare.py keeps what it has measured: its table is never half-written, a damaged one
is named in one line, a dead server's cells say they failed, and no adapter takes another row."""

import json
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import compare  # noqa: E402

FAST = ["--episodes", "2", "--no-default-adapter"]


def first_table(out):
    return compare.main([*FAST, "--agents", "random", "--games", "frozen_lake", "--out", str(out)])


@pytest.mark.parametrize("damage", [lambda text: text[:len(text) // 2], lambda text: "[1, 2]",
                                    lambda text: "\x00" * 100])
def test_a_damaged_table_is_named_in_one_line_and_kept(tmp_path, damage):
    first_table(tmp_path)
    path = tmp_path / "comparison.json"
    path.write_text(damage(path.read_text()))
    damaged = path.read_bytes()
    for extra in ([], ["--replace"]):
        with pytest.raises(SystemExit) as stop:
            compare.main([*FAST, "--agents", "optimal", "--games", "frozen_lake",
                          "--out", str(tmp_path), *extra])
        message = str(stop.value.code)
        assert str(path) in message and "damaged" in message and "\n" not in message
        assert path.read_bytes() == damaged


def test_a_write_cut_short_by_a_full_disk_leaves_the_old_table(tmp_path):
    """The second command's table is larger than the files may grow (as on a full disk)."""
    first_table(tmp_path)
    saved = {name: (tmp_path / name).read_bytes() for name in ("comparison.json", "comparison.md")}
    limit = max(len(data) for data in saved.values()) + 50

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, compare.__file__, *FAST, "--agents", "optimal",
                             "--games", "frozen_lake,snake", "--out", str(tmp_path)],
                            capture_output=True, text=True, preexec_fn=small_disk, env=env)
    assert result.returncode != 0 and "File too large" in result.stderr
    assert {name: (tmp_path / name).read_bytes() for name in saved} == saved
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(saved)  # no temporary file


def closed_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_dead_servers_cells_say_they_failed_each_with_its_own_count(tmp_path):
    report = compare.main([*FAST, "--agents", "server", "--games", "frozen_lake,snake",
                           "--base-url", f"http://127.0.0.1:{closed_port()}/v1", "--model", "m",
                           "--retries", "0", "--out", str(tmp_path)])
    cells = report["results"]["server m"]
    for cell in cells.values():  # one request a step, counted in its own cell only
        requests = round(cell["episodes"] * cell["mean_steps"])
        assert cell["requests"] == cell["failed_requests"] == requests
        assert cell["request_errors"] == {"ConnectionRefusedError": requests}
    lake, snake = cells["frozen_lake"]["requests"], cells["snake"]["requests"]
    assert lake == 2 * 16  # stays put to the step limit; the snake runs into a wall
    table = (tmp_path / "comparison.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| server m |"))
    assert row == (f"| server m | **failed**: {lake} of {lake} requests failed "
                   f"| **failed**: {snake} of {snake} requests failed |")
    assert (f"- server m on snake: {snake} of {snake} requests failed "
            f"(ConnectionRefusedError {snake})") in table


def test_a_cell_with_some_failed_requests_shows_its_score_and_the_count():
    result = {"score": 0.5, "score_ci95": [0.25, 0.75], "fraction_of_optimum": 0.5,
              "requests": 10, "failed_requests": 3}
    assert compare.cell_text(result) == "0.500 [0.250, 0.750] · 50% (3 of 10 requests failed)"
    assert compare.cell_text({**result, "failed_requests": 0}) == "0.500 [0.250, 0.750] · 50%"


@pytest.mark.parametrize("adapters, named", [
    (["random=/a"], "'random'"), (["dqn=/a"], "'dqn'"), (["server=/a"], "'server m'"),
    (["mine=/a", "mine=/b"], "given twice")])
def test_an_adapter_may_not_take_another_rows_name(tmp_path, adapters, named):
    argv = [*FAST, "--agents", "random", "--games", "frozen_lake", "--out", str(tmp_path),
            "--base-url", "http://127.0.0.1:9/v1", "--model", "m"]
    for adapter in adapters:
        argv += ["--adapter", adapter]
    with pytest.raises(SystemExit) as stop:
        compare.main(argv)
    message = str(stop.value.code)
    assert "--adapter" in message and named in message and "\n" not in message
    assert not list(tmp_path.iterdir())


def test_episodes_beyond_the_cap_are_refused_before_any_seed_is_drawn(tmp_path, monkeypatch):
    def no_seeds(n):
        raise AssertionError("seeds were drawn")

    monkeypatch.setattr(compare.envs, "heldout_seeds", no_seeds)
    with pytest.raises(SystemExit) as stop:
        compare.main(["--episodes", "1000000000", "--no-default-adapter", "--agents", "random",
                      "--games", "frozen_lake", "--out", str(tmp_path)])
    message = str(stop.value.code)
    assert "--episodes" in message and "100000" in message and "\n" not in message
    assert not list(tmp_path.iterdir())


def test_the_agent_seed_is_recorded_in_the_json_and_the_title(tmp_path):
    report = compare.main([*FAST, "--agents", "random", "--games", "frozen_lake", "--seed", "7",
                           "--out", str(tmp_path)])
    assert report["agent_seed"] == 7
    saved = json.loads((tmp_path / "comparison.json").read_text())
    assert saved["agent_seed"] == 7 and saved["results"] == report["results"]
    title = (tmp_path / "comparison.md").read_text().splitlines()[0]
    assert title.startswith("# ") and "agent seed 7" in title


def two_cell_table(out):
    return compare.main([*FAST, "--agents", "random,optimal", "--games", "frozen_lake",
                         "--out", str(out)])


def test_a_cell_of_another_agent_seed_never_joins_the_table(tmp_path):
    two_cell_table(tmp_path)
    saved = {name: (tmp_path / name).read_bytes() for name in ("comparison.json", "comparison.md")}
    with pytest.raises(SystemExit) as stop:
        compare.main([*FAST, "--agents", "random", "--games", "frozen_lake", "--seed", "7",
                       "--out", str(tmp_path)])
    message = str(stop.value.code)
    assert "--seed 0" in message and "\n" not in message
    assert {name: (tmp_path / name).read_bytes() for name in saved} == saved
    replaced = compare.main([*FAST, "--agents", "random", "--games", "frozen_lake", "--seed", "7",
                             "--out", str(tmp_path), "--replace"])
    assert replaced["agent_seed"] == 7 and list(replaced["results"]) == ["random"]


def test_a_table_saved_without_an_agent_seed_is_taken_as_seed_0(tmp_path):
    two_cell_table(tmp_path)
    path = tmp_path / "comparison.json"
    older = json.loads(path.read_text())
    del older["agent_seed"]
    path.write_text(json.dumps(older))
    updated = compare.main([*FAST, "--agents", "random", "--games", "frozen_lake",
                            "--out", str(tmp_path)])
    assert list(updated["results"]) == ["random", "optimal"] and updated["agent_seed"] == 0
    path.write_text(json.dumps(older))
    with pytest.raises(SystemExit):
        compare.main([*FAST, "--agents", "random", "--games", "frozen_lake", "--seed", "3",
                      "--out", str(tmp_path)])
    assert json.loads(path.read_text()) == older
