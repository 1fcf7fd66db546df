"""When each job of a Snakemake run started and ended, read from Snakemake's own log of the run
(.snakemake/log/*.snakemake.log), and the most bytes a directory held meanwhile: what overlapped what
and how much disk it took, for the stream-mode tests and benchmarks."""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

_STAMP = re.compile(r"\[(\w{3} \w{3}\s+\d+ [\d:]+ \d{4})\]")


@dataclass
class Job:
    rule: str
    wildcards: dict[str, str]
    start: datetime
    end: datetime

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()


def latest_log(workdir) -> Path:
    logs = sorted((Path(workdir) / ".snakemake" / "log").glob("*.snakemake.log"))
    if not logs:
        raise FileNotFoundError(f"no Snakemake log under {workdir}/.snakemake/log")
    return logs[-1]


def job_times(log_file) -> list[Job]:
    """Every job that finished, with its rule, wildcards and start and end (to the second, as the log
    stamps them), in the order they finished."""
    stamp, started, done, current = None, {}, [], None
    for line in Path(log_file).read_text().splitlines():
        if m := _STAMP.fullmatch(line.strip()):
            stamp = datetime.strptime(" ".join(m.group(1).split()), "%a %b %d %H:%M:%S %Y")
        elif m := re.match(r"(?:local)?(?:rule|checkpoint) (\w+):", line):
            current = {"rule": m.group(1), "wildcards": {}, "start": stamp}
        elif current is not None and (m := re.match(r"\s+jobid: (\d+)", line)):
            started[m.group(1)] = current
        elif current is not None and (m := re.match(r"\s+wildcards: (.*)", line)):
            current["wildcards"] = dict(kv.split("=", 1) for kv in m.group(1).split(", "))
        elif m := re.match(r"Finished jobid: (\d+)", line.strip()):
            job = started.pop(m.group(1), None)
            if job is not None:
                done.append(Job(job["rule"], job["wildcards"], job["start"], stamp))
    return done


def overlap_s(a: Job, b: Job) -> float:
    """Seconds during which both jobs ran."""
    return max(0.0, (min(a.end, b.end) - max(a.start, b.start)).total_seconds())


class DiskWatch:
    """The most bytes under a directory at any moment of a run, sampled from a thread every `every_s`."""

    def __init__(self, path, every_s: float = 0.005):
        self.path, self.every_s, self.peak, self.samples = Path(path), every_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _size(self) -> int:
        total = 0
        for root, _, files in os.walk(self.path):  # a directory removed while walked is skipped
            for name in files:
                try:
                    total += os.stat(os.path.join(root, name)).st_size
                except FileNotFoundError:  # removed between listing and stat
                    pass
        return total

    def _run(self):
        while not self._stop.wait(self.every_s):
            self.peak, self.samples = max(self.peak, self._size()), self.samples + 1

    def close(self) -> int:
        """Stop sampling; the peak in bytes."""
        self._stop.set()
        self._thread.join()
        return self.peak
