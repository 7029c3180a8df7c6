"""Bad command lines stop at once, before any model loads: a one-line message, a non-zero exit, no
traceback. Damaged run files are named in the message."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import baselines
import msgrpo
import support


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    def load_policy(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(msgrpo, "load_policy", load_policy)


def stopped(argv, main=msgrpo.main):
    """The message a command line stops with (SystemExit, non-zero, one line)."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    message = str(stop.value.code).strip()
    assert stop.value.code not in (0, None) and message and "\n" not in message
    return message


@pytest.mark.parametrize("argv, named", [
    (["--iterations", "-1"], "--iterations"), (["--group-size", "1"], "--group-size"),
    (["--temperature", "-1"], "--temperature"), (["--temperature", "0"], "--temperature"),
    (["--temperature", "nan"], "--temperature"), (["--groups", "0"], "--groups"),
    (["--lr", "nan"], "--lr"), (["--lr", "inf"], "--lr"), (["--lr", "0"], "--lr"),
    (["--invalid-penalty", "nan"], "--invalid-penalty"),
    (["--invalid-penalty=-inf"], "--invalid-penalty"),
    (["--invalid-penalty=-1e308"], "--invalid-penalty"),
    (["--env-opt", "size=abc"], "size"),
    (["--env-opt", "size=0"], "size"), (["--env-opt", "size=-3"], "size"),
    (["--env-opt", "colour=red"], "colour"), (["--env-opt", "slippery=maybe"], "slippery"),
    (["--env", "snake", "--env-opt", "opponent=2"], "opponent"),
    (["--env-opt", "map=SFX,FFG"], "map"), (["--env-opt", "start=corner"], "start"),
    (["--seed", "-1"], "--seed"), (["--seed", "18446744073709551616"], "--seed"),
    (["--lr", "1e39"], "--lr is 1e+39; it must be above 0 and at most 1"),
    (["--late-lr", "2"], "--late-lr"),
    (["--model", "/nonexistent/dir"], "/nonexistent/dir is no folder"),
    (["--env", "snake", "--env-opt", "size=3000"], "from 5 to 32")])
def test_bad_settings_stop_before_the_model_loads(argv, named, tmp_path):
    assert named in stopped(argv + ["--run-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


def validate(**settings):
    cfg = msgrpo.resolve_defaults(msgrpo.Config(**settings))
    support.validate_config(cfg, msgrpo.env_options(cfg))


def test_a_start_game_option_warns_that_evaluation_starts_there_too(tmp_path, capsys):
    validate(env_options={"start": "ice"}, run_dir=str(tmp_path / "r"))
    assert "held-out evaluation" in capsys.readouterr().err
    validate(run_dir=str(tmp_path / "r"))
    assert capsys.readouterr().err == ""


def test_training_starts_are_checked_and_old_runs_keep_theirs(tmp_path):
    with pytest.raises(SystemExit, match="--training-start is corner; for frozen_lake it must be "
                                         "one of S, ice"):
        validate(training_start="corner", run_dir=str(tmp_path))
    with pytest.raises(SystemExit, match="for snake it must be one of standard, facing_wall"):
        validate(env="snake", training_start="beside_hole", run_dir=str(tmp_path))
    # config.json before starts had names
    for exploring, start in ((True, "beside_hole"), (False, "S")):
        (tmp_path / "config.json").write_text(json.dumps({"env": "frozen_lake",
                                                          "exploring_starts": exploring}))
        assert support.load_config(tmp_path, msgrpo.Config,
                                   msgrpo.resolve_defaults).training_start == start


def test_a_run_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    assert "is a file" in stopped(["--run-dir", str(tmp_path / "file")])


@pytest.fixture
def saved_run(tmp_path):
    """A run folder as training leaves it after 2 iterations (no model needed to read it)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = msgrpo.resolve_defaults(msgrpo.Config(model="tiny", iterations=2,
                                                env_options={"max_steps": 8},
                                                run_dir=str(run_dir)))
    support.save_json(run_dir / "config.json", msgrpo.dataclasses.asdict(cfg))
    torch.save({"iteration": 2, "optimizer": {}, "lora": {}}, run_dir / "checkpoint.pt")
    (run_dir / "metrics.jsonl").write_text(metrics_lines(1, 2))
    support.save_json(run_dir / "eval.json", [EVALUATION])
    return run_dir


CURVES = {"mean_return": 0.0, "success_rate": 0.0, "invalid_rate": 1.0, "distinct_responses": 0.5,
          "entropy": 2.0, "zero_variance_groups": 8}  # what the curves read of a metrics line
EVALUATION = {"iteration": 0, "episodes": 2, "success_rate": 0.0, "success_ci95": [0.0, 0.8],
              "mean_return": 0.0, "return_ci95": [0.0, 0.0], "invalid_rate": 1.0}


def metrics_lines(*iterations, **fields):
    return "".join(json.dumps({"iteration": i, **CURVES, **fields}) + "\n" for i in iterations)


@pytest.mark.parametrize("name, damaged", [
    ("metrics.jsonl", metrics_lines(1)),  # a line lost: 1 line, a checkpoint of iteration 2
    ("metrics.jsonl", '{"iteration": 1}\n' + metrics_lines(2)),
    ("metrics.jsonl", metrics_lines(1, 2, entropy="high")),
    ("checkpoint.pt", -1), ("checkpoint.pt", "2"), ("checkpoint.pt", 2.0), ("checkpoint.pt", True),
    ("eval.json", {"iteration": 0}), ("eval.json", [0, 1]), ("eval.json", [{"episodes": 2}]),
    ("eval.json", [{**EVALUATION, "iteration": "0"}]), ("eval.json", [{"iteration": 0}]),
    ("config.json", {"groups": "eight"}), ("config.json", {"quantize": "yes"}),
    ("config.json", {"lr": "fast"}), ("config.json", {"groups": True}),
    ("config.json", {"env_options": ["size", 4]})])
def test_resume_checks_the_run_files_against_each_other_before_the_model_loads(saved_run, name,
                                                                               damaged):
    """Found before any training: not after an iteration has trained, in the plot at the end, or as
    a traceback."""
    path = saved_run / name
    if name == "checkpoint.pt":
        torch.save({"iteration": damaged, "optimizer": {}, "lora": {}}, path)
    elif name == "config.json":
        path.write_text(json.dumps({**json.loads(path.read_text()), **damaged}))
    else:
        path.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    assert str(path) in stopped(["--resume", str(saved_run)])


@pytest.mark.parametrize("name, damage", [("checkpoint.pt", b"PK\x03\x04 half a checkpoint"),
                                          ("config.json", b'{"iterations": 2, '),
                                          ("metrics.jsonl", b'{"iteration": 1}\n{"iterat'),
                                          ("eval.json", b"[{")])
def test_a_damaged_run_file_is_named(saved_run, name, damage):
    (saved_run / name).write_bytes(damage)
    message = stopped(["--resume", str(saved_run)])
    assert str(saved_run / name) in message


@pytest.mark.parametrize("lines, named", [
    ([1, 2, 1, 3, 2], "line 3: iteration 1 comes a second time"),  # two runs' lines interleaved
    ([1, 3], "line 2: iteration 3 where 2 is due: iteration 2 is missing"),
    ([2, 3], "line 1: iteration 2 where 1 is due"), (["one"], "line 1: iteration 'one'")])
def test_metrics_with_a_repeated_or_missing_iteration_are_refused_by_name(saved_run, lines, named):
    (saved_run / "metrics.jsonl").write_text(metrics_lines(*lines))
    with pytest.raises(SystemExit, match=named):
        support.read_metrics(saved_run)
    assert str(saved_run / "metrics.jsonl") in stopped(["--resume", str(saved_run)])


def test_a_folder_that_cannot_be_written_is_refused_before_the_model_loads(saved_run, tmp_path,
                                                                           monkeypatch):
    saved_run.chmod(0o555)
    if os.geteuid() == 0:  # root writes there anyway: answer as the folder's mode says
        monkeypatch.setattr(os, "access", lambda path, mode: bool(
            os.stat(path).st_mode & stat.S_IWUSR) or not mode & os.W_OK)
    try:
        assert f"cannot write in {saved_run}" in stopped(["--resume", str(saved_run)])
        assert f"cannot write in {saved_run}" in stopped(["--run-dir", str(saved_run / "new")])
    finally:
        saved_run.chmod(0o755)


def test_a_config_json_whose_lora_r_was_edited_is_refused_before_the_model_loads(saved_run):
    lora = {f"layers.{i}.q_proj.lora_A.default.weight": torch.zeros(8, 64) for i in range(2)}
    torch.save({"iteration": 2, "optimizer": {}, "lora": lora}, saved_run / "checkpoint.pt")
    config = json.loads((saved_run / "config.json").read_text())
    (saved_run / "config.json").write_text(json.dumps({**config, "lora_r": 4}))
    message = stopped(["--resume", str(saved_run)])
    assert "lora_r 4" in message and "rank 8" in message
    assert str(saved_run / "config.json") in message


@pytest.mark.parametrize("flags, named", [
    (["--env", "snake"], "env frozen_lake"), (["--seed", "7"], "seed 0"),
    (["--model", "smollm2-135m"], "model tiny"), (["--lora-r", "4"], "LoRA rank 8")])
def test_resume_refuses_what_would_make_it_another_run(saved_run, flags, named):
    before = (saved_run / "config.json").read_text()
    message = stopped(["--resume", str(saved_run), *flags])
    assert flags[0] in message and named in message and "--resume keeps" in message
    assert (saved_run / "config.json").read_text() == before


def test_each_setting_of_config_is_a_flag_and_only_the_flags_given_are_parsed():
    parser = msgrpo.build_parser()
    fields = msgrpo.dataclasses.fields(msgrpo.Config)
    assert all(field.metadata["help"] for field in fields)
    assert {field.name for field in fields} <= {action.dest for action in parser._actions}
    assert vars(parser.parse_args([])) == {}  # so a resumed run keeps what is not given
    args = parser.parse_args(["--lora_r", "4", "--no-std", "--std", "--no-quantize", "--think",
                              "--no-gradient-checkpointing", "--env-opt", "size=4"])
    assert vars(args) == {"lora_r": 4, "scale_advantages": True, "quantize": False, "think": True,
                          "gradient_checkpointing": False, "env_options": [("size", "4")]}


def test_resume_takes_new_training_settings_and_the_run_s_own_values(saved_run):
    args = msgrpo.build_parser().parse_args([
        "--resume", str(saved_run), "--iterations", "5", "--lr", "1e-3", "--late-after", "3",
        "--eval-episodes", "2", "--seed", "0", "--env", "frozen_lake", "--model", "tiny"])
    cfg, resume = support.config_from_args(args, msgrpo.Config, msgrpo.resolve_defaults,
                                           msgrpo.env_options)
    assert resume and (cfg.iterations, cfg.lr, cfg.late_after, cfg.eval_episodes) == (5, 1e-3, 3, 2)


def test_resume_refuses_another_algorithm_and_names_the_command_that_resumes(saved_run):
    config = json.loads((saved_run / "config.json").read_text())
    assert "msgrpo.py --resume" in stopped(["ntpo", "--resume", str(saved_run)], baselines.main)
    (saved_run / "config.json").write_text(json.dumps({**config, "algo": "poad"}))
    assert "baselines.py poad --resume" in stopped(["--resume", str(saved_run)])
    ntpo_resume = ["ntpo", "--resume", str(saved_run)]
    assert "baselines.py poad --resume" in stopped(ntpo_resume, baselines.main)
    assert json.loads((saved_run / "config.json").read_text())["algo"] == "poad"


HOLD = """import sys, support
with support.owned_run_folder(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_folder_another_process_trains_in_is_refused_and_a_killed_one_frees_it(saved_run):
    """Two runs into one folder would interleave their metrics lines and overwrite each other's
    config.json and evaluations: while one trains, the other stops with one line, before its model
    loads, and the folder is left as the first has it."""
    repo = Path(__file__).resolve().parent.parent
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(saved_run)], cwd=repo, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        assert holder.stdout.readline().strip() == "held"
        before = {p.name: p.read_bytes() for p in saved_run.iterdir()}
        for argv in (["--resume", str(saved_run)],
                     ["--run-dir", str(saved_run), "--overwrite", "--model", "tiny"]):
            message = stopped(argv)
            assert "in use by another run" in message and f"process {holder.pid}" in message
        assert {p.name: p.read_bytes() for p in saved_run.iterdir()} == before
    finally:
        holder.kill()  # as a crash or kill -9 would: the lock goes with the process
        holder.wait()
    assert (saved_run / support.LOCK_FILE).exists()  # left behind, and blocks nothing
    with pytest.raises(AssertionError, match="the model was loaded"):  # past the lock
        msgrpo.main(["--resume", str(saved_run)])
    assert not (saved_run / support.LOCK_FILE).exists()  # let go when train ended


def test_resume_refuses_fewer_iterations_than_trained_and_a_missing_checkpoint(saved_run):
    assert "--iterations 1" in stopped(["--resume", str(saved_run), "--iterations", "1"])
    (saved_run / "checkpoint.pt").unlink()
    assert "checkpoint.pt" in stopped(["--resume", str(saved_run)])
    assert "nothing to resume" in stopped(["--resume", str(saved_run / "nowhere")])


def test_an_older_checkpoint_without_its_adapter_names_the_folder(saved_run):
    torch.save({"iteration": 2, "optimizer": {}, "numpy_rng": None, "torch_rng": None},
               saved_run / "checkpoint.pt")
    assert str(saved_run / "adapter") in stopped(["--resume", str(saved_run)])


def test_resume_adds_game_options_to_the_saved_ones(saved_run):
    args = msgrpo.build_parser().parse_args(["--resume", str(saved_run),
                                             "--env-opt", "slippery=true"])
    cfg, resume = support.config_from_args(args, msgrpo.Config, msgrpo.resolve_defaults,
                                           msgrpo.env_options)
    assert resume and cfg.env_options == {"max_steps": 8, "slippery": True}
    assert "size" in stopped(["--resume", str(saved_run), "--env-opt", "size=0"])


def test_resume_and_overwrite_do_not_mix(saved_run):
    assert "--overwrite" in stopped(["--resume", str(saved_run), "--overwrite"])
    assert json.loads((saved_run / "config.json").read_text())["iterations"] == 2


def test_baselines_refuses_a_model_folder_that_is_not_there(tmp_path):
    message = stopped(["--agent", "llm", "--llm-model", str(tmp_path / "nowhere")], baselines.main)
    assert f"--llm-model {tmp_path / 'nowhere'} is no folder" in message


def test_baselines_names_a_missing_adapter_folder(tmp_path, capsys):
    with pytest.raises(SystemExit):
        baselines.main(["--agent", "llm", "--adapter", str(tmp_path / "nowhere")])
    assert str(tmp_path / "nowhere") in capsys.readouterr().err


def files_in(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


MODEL_CONFIG = '{"model_type": "llama"}'


@pytest.mark.parametrize("foreign", [{"config.json": MODEL_CONFIG, "model.safetensors": "weights"},
                                     {"config.json": MODEL_CONFIG}, {"notes.txt": "mine"}])
def test_a_folder_that_holds_something_else_than_a_run_is_never_written(saved_run, foreign):
    """A model's folder (its config.json has no env) or a run with a file of someone else's: no new
    run, --overwrite or --resume writes there, and nothing in it is deleted."""
    if "config.json" in foreign:
        for path in saved_run.iterdir():
            path.unlink()
    for name, text in foreign.items():
        (saved_run / name).write_text(text)
    before = files_in(saved_run)
    for argv in (["--run-dir", str(saved_run)], ["--run-dir", str(saved_run), "--overwrite"],
                 ["--resume", str(saved_run)]):
        message = stopped(argv + ["--model", "tiny"] * (argv[0] == "--run-dir"))
        assert str(saved_run) in message and any(name in message for name in foreign)
    assert files_in(saved_run) == before


def test_a_lock_file_that_is_a_link_is_refused_and_what_it_points_to_is_untouched(saved_run,
                                                                                   tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("not a lock")
    (saved_run / support.LOCK_FILE).symlink_to(precious)
    assert support.LOCK_FILE in stopped(["--resume", str(saved_run)])
    with pytest.raises(SystemExit, match=support.LOCK_FILE):  # opened without following the link
        with support.owned_run_folder(saved_run):
            pass
    assert precious.read_text() == "not a lock" and (saved_run / support.LOCK_FILE).is_symlink()


@pytest.mark.parametrize("argv", [
    ["--resume", ""], ["--run-dir", ""], ["--model", ""], ["--resume", " "],
    ["--invalid-penalty", "-0.5", "--env-opt", "invalid_penalty=-0.2"]])
def test_empty_paths_and_settings_given_twice_disagreeing_are_refused(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a run started by mistake would write runs/
    run_dir = [] if {"--run-dir", "--resume"} & set(argv) else ["--run-dir", str(tmp_path / "run")]
    assert argv[0] in stopped(argv + run_dir) and list(tmp_path.iterdir()) == []


def config_of(argv):
    args = msgrpo.build_parser().parse_args(argv)
    return support.config_from_args(args, msgrpo.Config, msgrpo.resolve_defaults,
                                    msgrpo.env_options)[0]


def test_an_invalid_penalty_game_option_is_the_run_s_invalid_penalty(tmp_path):
    """Given either way, or both ways alike, config.json records the penalty the games add."""
    option = ["--env-opt", "invalid_penalty=-0.5"]
    for flags in (option, ["--invalid-penalty=-0.5", *option]):
        cfg = config_of(flags + ["--run-dir", str(tmp_path)])
        assert cfg.invalid_penalty == msgrpo.env_options(cfg)["invalid_penalty"] == -0.5


CAPS = {"--groups": 4096, "--group-size": 4096, "--lora-r": 4096, "--micro-batch": 4096,
        "--eval-batch": 4096, "--max-new-tokens": 8192, "--iterations": 1_000_000,
        "--eval-episodes": 100_000}


@pytest.mark.parametrize("flag, cap", [*CAPS.items(), ("--invalid-penalty", 1000),
                                       ("--invalid-penalty", -1000)])
def test_sizes_past_their_cap_stop_before_anything_is_allocated(flag, cap, tmp_path):
    past = cap + (1 if cap > 0 else -1)
    message = stopped([f"{flag}={past}", "--run-dir", str(tmp_path / "run")])
    assert message.startswith(f"error: {flag} is {past}") and str(abs(cap)) in message


def test_sizes_at_their_cap_are_taken(tmp_path):
    cfg = config_of([f"{flag}={cap}" for flag, cap in CAPS.items()]
                    + ["--invalid-penalty=-1000", "--run-dir", str(tmp_path)])
    at_caps = (4096, 4096, 4096, 8192, 1_000_000, 100_000, -1000)
    assert (cfg.groups, cfg.group_size, cfg.lora_r, cfg.max_new_tokens, cfg.iterations,
            cfg.eval_episodes, cfg.invalid_penalty) == at_caps
