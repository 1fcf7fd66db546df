"""A long job's status line on the workflow's console: throttled, the last one always printed."""

import socket

from flashdraft.io import CONSOLE_ENV, CONSOLE_HOST_ENV, Throttle, console_status, job_label, progress


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_many_updates_in_a_short_time_give_at_most_one_line_and_the_last_always():
    clock, lines = Clock(), []
    bar = progress(
        total=1000, desc="train", unit="step", mininterval=0, console=Throttle(lines.append, 30, clock)
    )
    for _ in range(999):  # 10 s of updates, each one displayed by tqdm
        clock.t += 0.01
        bar.update(1)
    assert len(lines) <= 1
    bar.set_postfix(loss="2.310", tau="3.10", refresh=False)
    bar.update(1)
    bar.close()
    assert lines[-1].startswith("[") and "train: 1000/1000 (100%) [" in lines[-1]
    assert "ETA" in lines[-1] and "step/s, loss=2.310, tau=3.10]" in lines[-1]
    bar.close()  # a second close says nothing more
    assert len(lines) <= 2


def test_a_line_every_period_at_most():
    clock, lines = Clock(), []
    throttle = Throttle(lines.append, 30, clock)
    for i in range(1000):  # 100 s
        clock.t = i / 10
        throttle.line(f"{i}")
    assert lines == ["300", "600", "900"]
    throttle.line("last", final=True)
    assert lines[-1] == "last"


def test_the_console_is_the_workflow_s_on_its_host_only(tmp_path, monkeypatch):
    console = tmp_path / "console.txt"
    console.write_text("snakemake's own line\n")
    monkeypatch.delenv(CONSOLE_ENV, raising=False)
    assert console_status() is None  # outside a workflow
    monkeypatch.setenv(CONSOLE_ENV, str(console))
    monkeypatch.setenv(CONSOLE_HOST_ENV, "another-node")
    assert console_status() is None  # a SLURM job on another node: its log has it all
    monkeypatch.setenv(CONSOLE_HOST_ENV, socket.gethostname())
    console_status().line("status", final=True)
    assert console.read_text() == "snakemake's own line\nstatus\n"  # appended


def test_a_job_is_named_by_its_script_and_shard():
    assert job_label(["/x/scripts/train.py", "--cfg", "{}"]) == "train"
    argv = ["/x/scripts/hidden_shard.py", "--shard", "00001", "--num-shards", "2"]
    assert job_label(argv) == "hidden_shard 00001"
