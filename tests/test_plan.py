"""The run plan: worked out once from a Config, the narrow settings the trainer reads, and the
debug hooks read from the environment at the entry point only."""
import ast
import dataclasses
import os

import pytest

from mpips.config import parse_args
from mpips.job.hooks import ENV, Hooks
from mpips.job.plan import TrainerSettings, make_plan, trainer_settings
from mpips.schema import Schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _is_cfg(v):
    return (isinstance(v, ast.Name) and v.id == "cfg") or (
        isinstance(v, ast.Attribute) and v.attr == "cfg")


def _cfg_reads(path):
    """Attribute names read off ``cfg`` or ``self.cfg`` in a source file, as ``cfg.name``
    or as ``getattr(cfg, "name", ...)`` (a default there would hide a missing field)."""
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Attribute) and _is_cfg(node.value):
            out.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "getattr" and node.args and _is_cfg(node.args[0])):
            name = node.args[1] if len(node.args) > 1 else None
            out.add(name.value if isinstance(name, ast.Constant) else "getattr(cfg, ?)")
    return out


def test_trainer_settings_hold_every_setting_the_worker_code_reads():
    """The trainers take TrainerSettings, not the Config: any setting they read must be
    one of its fields (else a run fails at the first read)."""
    folder = os.path.join(ROOT, "mpips", "worker")
    reads = set().union(*(_cfg_reads(os.path.join(folder, f)) for f in os.listdir(folder)
                          if f.endswith(".py")))
    fields = {f.name for f in dataclasses.fields(TrainerSettings)}
    assert reads and reads <= fields, sorted(reads - fields)
    cfg = parse_args(["--mode", "geo", "--geo-steps", "7", "--save-dir", "d", "--save-every",
                      "30", "--entry", "count:2", "--lr", "0.25"])
    s = trainer_settings(cfg)
    assert (s.geo_steps, s.save_steps, s.entry, s.lr, s.save_dir) == (7, 30, "count:2", 0.25,
                                                                       "d")


def test_plan_resolves_the_run_once(tmp_path):
    schema = tmp_path / "s.toml"
    schema.write_text('format = "csv"\nlabel = "y"\npipe_command = "cat"\n'
                      '[[dense]]\nnames = ["a"]\n[[sparse]]\nnames = ["b", "c"]\n')
    train = tmp_path / "t.csv"
    train.write_text("y,a,b,c\n1,2,x,y\n")
    cfg = parse_args(["--local", "--schema", str(schema), "--fc", "16, 8", "--local-workers",
                      "3", "--mode", "sync", "--train", str(train)])
    plan = make_plan(cfg)
    assert plan.hidden == (16, 8) and plan.width == 3 and plan.sync
    assert plan.schema.n_sparse == 2 and plan.schema.pipe_command == "cat"
    assert plan.model.n_sparse == 2 and plan.model.n_dense == 1
    assert plan.train_files == [str(train)] and plan.test_files == []
    assert plan.resume is None and plan.start == (0, 0) and plan.with_data() is plan
    sim = make_plan(parse_args(["--local", "--simulate-workers", "4", "--mode", "ssp",
                                "--staleness", "1"]))
    assert sim.width == 4 and not sim.sync and sim.schema == Schema.criteo()
    assert sim.train_files is None                      # the embedded set: made at the start


def test_hooks_are_read_from_the_environment_given():
    env = {ENV["slow_worker"]: "1:0.5", ENV["stretch_worker"]: "0:2",
           ENV["kill_at"]: "20261129/02:3", ENV["progress_steps"]: "7", ENV["list_jit"]: "1",
           ENV["signal_at"]: "TERM:1:5"}
    h = Hooks.from_env(env)
    assert h.signaller(0) is None and callable(h.signaller(1))
    assert (h.step_delay(1), h.step_delay(0), h.stretch(0), h.stretch(1)) == (0.5, 0.0, 2.0, 0.0)
    assert h.progress_steps == 7 and h.list_jit
    assert h.killer("20261129/01") is None and callable(h.killer("20261129/02"))
    none = Hooks.from_env({})
    assert none == Hooks() and none.killer("") is None and none.step_delay(0) == 0.0
    assert none.signaller(0) is None


# Modules below the entry points that may read the environment, and why.
READS_ENV = {
    "mpips/job/hooks.py": "reads the debug hooks, once, for the entry point",
}


def test_nothing_below_the_entry_points_reads_the_environment():
    """os.environ / os.getenv appear only in the entry points and READS_ENV."""
    bad = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "mpips")):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
            if not f.endswith(".py") or rel in READS_ENV or os.path.dirname(rel) == "mpips":
                continue
            text = open(os.path.join(dirpath, f), encoding="utf-8").read()
            if "os.environ" in text or "os.getenv" in text:
                bad.append(rel)
    assert bad == []


@pytest.mark.parametrize("argv, msg", [
    (["--resume", "/nonexistent/ckpts"], "no such checkpoint"),
])
def test_plan_refuses_before_any_work(argv, msg):
    with pytest.raises(ValueError, match=msg):
        make_plan(parse_args(["--local", *argv]))
