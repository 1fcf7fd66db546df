import json
import os
import shlex
import shutil
import sys
from pathlib import Path

REPO = Path(workflow.basedir).parent
sys.path.insert(0, str(REPO / "src"))

from flashdraft.config import (  # noqa: E402
    WARMUP_TRAIN_KEYS,
    Config,
    needs_last_hidden,
    stage_params,
    train_world as config_train_world,
)
from flashdraft.config_check import (  # noqa: E402
    Problems,
    check_fp8_gpus,
    configfile_problems,
    file_problems,
    fp8_problem,
    gpu_problems,
    overlay_problem,
)
from flashdraft.config_load import read as read_data  # noqa: E402
from flashdraft.gpu import gpu_capabilities, gpu_memory_bytes, visible_gpus  # noqa: E402
from flashdraft import memory  # noqa: E402
from flashdraft.disk import disk_problem  # noqa: E402
from flashdraft.errors import FailureConsole, UserError  # noqa: E402
from flashdraft.estimate_inputs import target_shapes  # noqa: E402
from flashdraft.io import console_env, file_digests  # noqa: E402
from flashdraft.reruns import deleted_line, deleted_shards, redo_lines  # noqa: E402
from flashdraft.shards import shard_sources  # noqa: E402
from flashdraft.launch import on_every_node, torchrun  # noqa: E402


def read_config():
    """The config as a Config, once every check that needs no job has run: all the problems found, one line
    each, end the run in one stop() before any job (the warnings are printed either way)."""
    results = str(config.get("results", "results"))
    found = Problems(configfile_problems(workflow.overwrite_configfiles, results))
    if not found.lines:  # a target read as a config: its keys' lines would only hide that
        overlay = overlay_problem(workflow.overwrite_configfiles, config)
        found.lines += [overlay] if overlay else []
        read = read_data(config, absent_target_ok=True)  # Snakemake merged the files as config_load.load
        found.lines += read.schema  # one line naming each key, not the whole schema
        cfg = read.cfg
        if cfg is not None:
            # the sources' first rows: once, not again in each job a cluster or a subprocess runs
            sources = file_problems(cfg, cfg.results.rstrip("/"), read_sources=workflow.is_main_process)
            found.lines += sources + read.problems + run_here_problems(cfg)
            if not found.lines:  # each GPU stage's predicted peak against the card
                found.lines += memory.check(cfg, gpu_memory_bytes)
            for w in read.warnings:
                print(f"warning: {w}", file=sys.stderr)
    if found.lines:
        stop(found.unique())
    return cfg


def stop(lines):
    """End the run before any job: the problems, one line each, as a list (no traceback: a mistake in the
    config is not a crash)."""
    head = f"flashdraft: the run cannot start: {len(lines)} problem{'s' if len(lines) > 1 else ''} to fix:"
    print("\n".join([head, *lines]), file=sys.stderr)
    raise SystemExit(1)


def check_run_disk():
    """Before the first job (onstart: not in a dry run, which writes nothing): the whole run's planned disk
    against the free space under its results directory (disk.py), once the target's shapes are known."""
    try:
        problem = disk_problem(CFG, target_shapes(CFG), RESULTS)
    except (UserError, KeyError, OSError, ValueError):  # a target or an earlier stage's file it cannot read
        return  # yet: the estimate is skipped, the job that reads the file names it
    if problem:
        stop([problem])


def run_here_problems(cfg):
    """The GPUs (and srun) of this node, when the jobs run here (gpus.check_visible): their count, and
    train.fp8 against their compute capability."""
    if not cfg.gpus.check_visible:
        return []
    visible = len(visible_gpus())
    found = Problems(gpu_problems(cfg, visible, shutil.which("srun") is not None))
    if cfg.train.fp8 and cfg.gpus.drafter and not visible:  # what float8 needs, beside the count's line
        found.lines.append(fp8_problem(cfg.train.fp8, True, visible=False))
    elif cfg.train.fp8:
        found.run(check_fp8_gpus, cfg, gpu_capabilities())
    return found.lines


CFG = read_config()

PY = sys.executable
SCRIPTS = REPO / "scripts"
RESULTS = CFG.results.rstrip("/")
LOGS = f"{RESULTS}/logs"
# Every stage's Python keeps its compiled bytecode in .snakemake/pycache. Images often set
# PYTHONDONTWRITEBYTECODE (or install read-only): each process then compiles torch's and Dynamo's
# sources again, seconds of every job's start, paid by every stream-mode chunk. Set in the environment
# the jobs inherit, not in their command lines, which Snakemake compares to rerun jobs (a moved work
# dir would rerun everything).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ.setdefault("PYTHONPYCACHEPREFIX", str(Path(".snakemake/pycache").absolute()))
BENCH = f"{RESULTS}/benchmarks"

# Hidden states depend on which layers are fused, not on the drafter's block size.
HIDDEN_DRAFTER_KEYS = ("num_layers", "target_layer_ids")
# drafter.family trains on the target's last hidden state: the hidden shards hold it too (one more column)
LAST_HIDDEN = needs_last_hidden(CFG.drafter)
LAST_HIDDEN_FLAGS = ["--last-hidden"] if LAST_HIDDEN else []  # the stages' flag (see last_hidden_params)


def check_last_hidden():
    """Before the first job (onstart: it needs the jobs Snakemake will run, which read_config's gathered
    checks run before knowing): when drafter.family trains on the target's last hidden state, the hidden
    shards on disk made without it that a job of this run reads and no job of it makes again, all named in
    one error. Snakemake makes such shards again by itself when it recorded their params
    (last_hidden_params); not for shards it has no record of (copied in), nor under --rerun-triggers
    without params."""
    if not LAST_HIDDEN:
        return
    jobs = list(workflow.dag.needrun_jobs())
    made = {str(f) for job in jobs for f in job.output}
    read = {str(f) for job in jobs for f in job.input} - made
    old, rules = [], set()
    for arrow in sorted(f for f in read if f.startswith(f"{RESULTS}/hidden/") and f.endswith(".arrow")):
        manifest = Path(arrow).with_suffix(".json")
        try:
            without = not json.loads(manifest.read_text()).get("last_hidden", False)
        except (OSError, ValueError, AttributeError):  # no readable manifest: verification names it
            continue
        if without:
            old.append(arrow)
            rules.update(["hidden_shard"] if Path(arrow).name.startswith("shard-") else
                         ["hidden_chunk", "hidden_val"])
    if old:
        shown = ", ".join(old[:3]) + (f" and {len(old) - 3} more" if len(old) > 3 else "")
        stop([f"config key drafter.family: {CFG.drafter.family} trains on the target's last hidden state, "
              f"but {len(old)} hidden shard(s) were made without it ({shown}); rerun the hidden stage "
              f"(snakemake --forcerun {' '.join(sorted(rules))})"])


def say_redone():
    """Before the first job: the costly stages' finished outputs this run makes again, and why."""
    jobs = [(job.rule.name, all(os.path.exists(f) for f in job.output),
             list(workflow.dag.reason(job).get_names())) for job in workflow.dag.needrun_jobs()]
    for line in redo_lines(jobs):
        print(f"note: {line}", file=sys.stderr)


def keep_previous_logs():
    """Before the first job: the log of each job about to run again (a killed training's, a failed
    stage's), which Snakemake would delete as the job starts, is kept beside it as <log>.previous."""
    for job in workflow.dag.needrun_jobs():
        for log in map(str, job.log):
            if os.path.isfile(log) and os.path.getsize(log):
                os.replace(log, f"{log}.previous")
                print(f"note: {log}: the previous attempt's log is {log}.previous", file=sys.stderr)


onstart:
    check_last_hidden()
    say_redone()
    check_run_disk()
    keep_previous_logs()


onerror:
    say_failed(log)


onsuccess:
    # a run that made the whole DAG ends with its result, not a path: tau, speedup, lossless, report, serve
    if any(job.rule.name == "all" for job in workflow.dag.targetjobs):
        from flashdraft.evaluate import run_end  # torch: imported once, at the end

        for line in run_end(RESULTS, CFG.target.path):
            print(line)


def section(name, keys=None):
    """A config section as JSON (defaults filled in), passed to a stage as --cfg and as its params.

    Returned as a params function: Snakemake would read `{...}` inside a plain string as a wildcard."""
    d = json.loads(json.dumps(getattr(CFG, name), default=lambda o: o.__dict__))
    if keys is not None:
        d = {k: d[k] for k in keys}
    text = json.dumps(stage_params(name, d), sort_keys=True)
    return lambda wildcards: text


def untracked(param):
    """A params function that gives what `param` gives, for a job's command line, but is no rerun trigger:
    Snakemake leaves params functions that take the job's `input` out of its params comparison (it counts
    them as derived from the inputs, whose changes rerun the job themselves)."""
    return lambda wildcards, input: param(wildcards)


def last_hidden_params():
    """Params of the stages that make or size hidden shards (hidden_shard; data_plan, hidden_chunk,
    hidden_val): `last_hidden` when drafter.family trains on the target's last hidden state, a rerun
    trigger (shards made without the column are made again once the family needs it, and the other way
    round); none otherwise, so such a run's params, and its shell commands (the flag goes in the untracked
    `cmd`, see stage), are what they were before the flag existed. Its value is the flag itself: Snakemake
    compares a job's params as a set of values, so a value another param has would trigger nothing."""
    return {"last_hidden": " ".join(LAST_HIDDEN_FLAGS)} if LAST_HIDDEN else {}


def source_digests(wildcards):
    """Params function: size and sha256 of each prompt source file the user brings, so that one rewritten
    under its old mtime (cp -p, rsync -t, tar x) reruns the prompts; digests are kept in .snakemake/
    between runs. Sources under results/ are a rule's outputs, which Snakemake tracks itself."""
    made = Path(RESULTS).resolve()
    paths = [s.path for s in CFG.prompts.sources if s.format != "hf" and Path(s.path).is_file()
             and not Path(s.path).resolve().is_relative_to(made)]
    return file_digests(paths, Path(".snakemake") / "flashdraft-source-digests.json")


def stage(script, gpus=None, nproc=None, nodes=1, flags=()):
    """The command that runs scripts/<script> (with `flags`, for a stage without torchrun): on `gpus`
    leased GPUs (see src/flashdraft/gpu.py), under torchrun with `nproc` processes (per node) when given,
    on `nodes` nodes through srun."""
    q = shlex.quote  # paths and config values may hold spaces, quotes or $(...)
    cmd = shlex.join([PY, str(SCRIPTS / script), *flags])
    if nproc is not None:
        # One process per GPU; --virtual-local-rank makes every rank see its GPU as cuda:0, so the
        # warmup's compile-cache entries (keyed by device index) hit on every rank.
        cmd = torchrun(PY, SCRIPTS / script, nproc, nodes, virtual=CFG.gpus.drafter > 0,
                       port=CFG.gpus.rdzv_port)
    if gpus is not None:
        locks = f" --lock-dir {q(CFG.gpus.lock_dir)}" if CFG.gpus.lock_dir else ""
        cmd = f"{q(PY)} -m flashdraft.gpu --gpus {gpus}{locks} -- {cmd}"
    cmd = on_every_node(cmd, nodes) if nodes > 1 else cmd
    # how a stage is launched (this interpreter's and the checkout's paths, the lease) changes no output:
    # a moved checkout or another path to the same environment reruns nothing
    return untracked(lambda wildcards: cmd)


def train_resources():
    """One node: `gpu` counts GPUs (for the local scheduler; the SLURM plugin turns it into --gpus).
    Several nodes (SLURM): `nodes` with `gres=gpu:G` on each; `mpi` makes the plugin run the job's
    command as it is instead of inside its own one-task srun, so the command's srun reaches every
    node; `tasks_per_gpu=0` keeps the plugin from deriving --ntasks-per-gpu from `tasks`."""
    n, g = CFG.gpus.drafter_nodes, CFG.gpus.drafter
    if n == 1:
        return {"gpu": g}
    res = {"nodes": n, "tasks": n, "mpi": "srun", "tasks_per_gpu": 0}
    if g:
        res["gres"] = f"gpu:{g}"
    return res


def parent(kind, key=0):
    """Params function: the directory of an input/output file, by position or name."""

    def f(wildcards, input, output):
        files = input if kind == "input" else output
        f = files[key] if isinstance(key, int) else getattr(files, key)
        return str(Path(f if isinstance(f, str) else f[0]).parent)  # a named list: its first file

    return f


def train_world():
    """Training processes: one per GPU (or one on the CPU) on each node."""
    return config_train_world(CFG.gpus)


def train_threads():
    """Training on GPUs: one core per process. On the CPU: one process on every core. The warmup uses
    the same count, since Inductor's CPU kernels (and so the compile-cache keys) depend on it."""
    return CFG.gpus.drafter if CFG.gpus.drafter > 0 else workflow.cores


def target_gpus():
    return 1 if CFG.gpus.target > 0 else 0


def target_dir():
    return CFG.target.path


def init_from():
    """drafter.init_from's files as inputs of the jobs that read them (none when it is unset): a changed
    file reruns them."""
    d = CFG.drafter.init_from
    return {"init": [f"{d}/config.json", f"{d}/model.safetensors"]} if d else {}


def regenerate_gpus():
    """openai: a server answers, this job only sends requests (the target dir gives the tokenizer);
    server: the job leases the GPUs of the server it starts (the lease's CUDA_VISIBLE_DEVICES);
    disabled: the sources' own answers are copied."""
    if not CFG.regenerate.enabled:
        return 0
    return {"openai": 0, "server": CFG.regenerate.server_gpus}.get(CFG.regenerate.backend, target_gpus())


def shard_ids():
    return [f"{i:05d}" for i in range(CFG.hidden.shards)]


def regenerate_shards():
    return CFG.regenerate.shards or CFG.hidden.shards


def regenerated(shards=None):
    """The regenerated conversations: one parquet file per regeneration shard (`shards`: which)."""
    shards = range(regenerate_shards()) if shards is None else shards
    return [f"{RESULTS}/regenerated/train/shard-{i:05d}.parquet" for i in shards]


def regenerated_for_hidden(wildcards):
    """Only the regeneration shards that hold hidden shard `wildcards.shard`'s rows: it starts as soon as
    they are done, and a rerun of one regeneration shard reruns only the hidden shards it feeds."""
    return regenerated(shard_sources(int(wildcards.shard), CFG.hidden.shards, regenerate_shards()))


def eval_shards():
    return CFG.eval.shards or max(1, CFG.gpus.target)


def eval_shard_files():
    return [f"{RESULTS}/eval/shards/shard-{i:05d}.parquet" for i in range(eval_shards())]


def shards_kept():
    """The shards a finished run keeps, inputs of the default target `all`: a plain rerun makes one deleted
    by hand again, with what depends on it (Snakemake makes a missing file only for a job that runs).
    Stream mode's hidden chunks are temp(): not these."""
    return regenerated() + hidden_kept()


def all_outputs(wildcards):
    """Input function of rule all, evaluated once the hidden-state mode's functions (included after rule
    all) have defined the mode interface."""
    return [
        *shards_kept(),
        *hidden_targets(),
        f"{RESULTS}/drafter/config.json",
        f"{RESULTS}/eval/summary.json",
        f"{RESULTS}/report.html",
        f"{RESULTS}/report_plots",
    ]


CONDA_ENV = "../../envs/flashdraft.yaml"


def rerun_command():
    """The snakemake command line that reruns this workflow as started (the Snakefile, config files and
    --config values it was given), for hidden_verify.py's message after it moved bad shards aside
    (into results/hidden/bad/, its default: bad/ next to the shards)."""
    cmd = ["snakemake"]
    snakefile = Path(workflow.main_snakefile).resolve()
    if snakefile != (Path.cwd() / "workflow" / "Snakefile").resolve():
        cmd += ["-s", str(snakefile)]
    if workflow.overwrite_configfiles:  # one flag for all: a second --configfile replaces the first
        cmd += ["--configfile", *(str(Path(f).resolve()) for f in workflow.overwrite_configfiles)]
    if workflow.config_settings.config_args:
        cmd += ["--config", *workflow.config_settings.config_args]
    return shlex.join(cmd + ["--cores", "all"])  # last: a target appended after it stays a target


# Through the environment, not a param: the way the workflow was started must not rerun the verify.
# setdefault: a job that runs Snakemake again (a cluster job) keeps the command of the first.
os.environ.setdefault("FLASHDRAFT_RERUN", rerun_command())


def failure_console():
    """The console says a failed job once, in two lines (flashdraft.errors.FailureConsole): the error its
    log ends with, and the log; Snakemake's account, with the job's 1-2 KB command line, goes to the run's
    complete log. Set on Snakemake's own console handler, which a logger plugin writing to the console
    replaces: that one's account stays as it is."""
    from snakemake.logging import logger

    for handler in logger.handlers:
        if handler.name == "DefaultStreamHandler" and handler.formatter is not None:
            if not isinstance(handler.formatter, FailureConsole):
                handler.setFormatter(FailureConsole(handler.formatter))
            return handler.formatter
    return None


def say_failed(logs):
    """When a job failed (onerror): how many, where the run's complete log is, and last on the console the
    command that reruns the run (with the targets it was given)."""
    n = len(FAILURES.failed) if FAILURES else 0
    whose = "its error and log" if n == 1 else "each one's error and log"
    said = [f"{n} job{'s' if n > 1 else ''} failed (above: {whose})" if n else ""]
    where = [os.path.relpath(f) if Path(f).resolve().is_relative_to(Path.cwd()) else f for f in logs]
    said += [f"Snakemake's account, with each job's command line: {', '.join(where)}" if where else ""]
    targets = workflow.dag_settings.targets
    targets = list(targets) if isinstance(targets, list | tuple) else sorted(targets or ())
    print("; ".join(["flashdraft: the run stopped", *filter(None, said)]), file=sys.stderr)
    print(f"rerun once fixed: {shlex.join(shlex.split(rerun_command()) + targets)}", file=sys.stderr)
    if FAILURES:
        FAILURES.summarized = True


def share_console():
    """The jobs' status lines (flashdraft.io.progress) go to this process's stderr, the console the user
    watches, while their output goes to their logs. Through the environment, which no rerun compares."""
    os.environ.update(console_env())


def say_files_on_disk():
    """What a run says at its start about files on disk (the Snakefile calls it once the hidden-state mode's
    functions are included): the shards deleted since the run that used them (the default target makes
    them again), then the mode's own lines."""
    gone = deleted_shards(shards_kept(), hidden_made_from())
    lines = [deleted_line(gone, rerun_command())] if gone else []
    for line in lines + hidden_notes():
        print(f"note: {line}", file=sys.stderr)


FAILURES = failure_console() if workflow.is_main_process else None  # a cluster job's log says it all
if workflow.is_main_process:  # not again in each job a cluster or a subprocess runs
    share_console()
