"""The decode and verify forwards compiled in a process of their own, and loaded by the server without tracing.

Compiled in the serving process, the warm-up traces in Python and holds the interpreter: on 2 cores the server
served at a fifth to four fifths of its eager speed for the 3 minutes it took (docs/performance.md#compiling).
Here a child process at the lowest CPU priority compiles each model's warm-up layouts ahead of time
(engine.worker.aot_graphs) into files beside inductor's cache, and the server loads them in seconds; a later
start that finds them current loads them before it answers (``at_start``), with the prompt graphs beside them
where their file is there (``add_prompts``; ``compile_prompts`` writes it). A file is named for what does not
change with a clone (engine.worker.graph_files) and checked against the code its graphs traced (``current``),
so one built from the same checkout anywhere loads here: the embedded pair ships its own in its compile cache
(engine.worker.compile_cache).

    python -m engine.worker.precompile SPEC.json    # what the server starts (``spawn``)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.layers import small_linear
from engine.worker import aot_graphs, kernel_call, model_guards
from engine.worker.aot_graphs import Entry, Precompiled, compile_runner, stale
from engine.worker.compile_cache import ENGINE_ROOT, tag_caches
from engine.worker.compile_lock import one_at_a_time
from engine.worker.graph_files import artifact, key, prompt_artifact  # noqa: F401 (key: where aot_graphs says, unedited)
from engine.worker.prompt_layouts import prompt_blocks, prompt_layouts
from engine.worker.warm_up_layouts import warm_up_blocks

logger = logging.getLogger(__name__)

PROGRESS = "engine.worker.aot_graphs: "  # how the child's progress lines start, after their time


@dataclasses.dataclass(frozen=True)
class Model:
    """One model to compile, as the server loaded it."""

    path: str
    dtype: str
    trust_remote_code: bool
    file: str  # where its graphs go
    draft: bool = False  # a draft proposes from a sequence's last row: a verify's layouts (a quarter) never run on it
    prompts: bool = False  # the prompt layouts (engine.worker.prompt_layouts) instead of the decode ones
    keys: str = ""  # the name its packed layers are keyed by ("": the file's): a prompt file's decode file's


def _dense(packed: torch.Tensor) -> torch.Tensor:
    return packed.to_dense() if packed.is_mkldnn else packed


def _rekey(model: torch.nn.Module, name: str) -> str:
    """Gives the model's packed layers the keys of the graphs in file ``name`` (small_linear.rekey): "" where they
    had no other owner, "shared" where they belong to the same checkpoint loaded earlier in this process (two
    engines of one model): each layer then takes that one's packed weight, checked equal, and the graphs run on
    either. "refused" where a weight differs, changing nothing."""
    if small_linear.rekey(model, name):
        return ""
    layers = [(small_linear.stable_key(name, n), m) for n, m in model.named_modules()
              if getattr(m, "packed_key", None) is not None]
    # The registry holds each key's packed weight weakly, for as long as a live layer owns it. Read here, not in
    # small_linear, whose text keys the graph files (a change there would leave the shipped ones stale).
    owned = [(small_linear._PACKED.get(k), m) for k, m in layers]
    if any(live is not None and not torch.equal(_dense(live), _dense(m.packed)) for live, m in owned):
        return "refused"
    for live, m in owned:
        if live is not None:
            m.packed = live
    return "shared" if small_linear.rekey(model, name) else "refused"


def load(runner: Any, path: Path, keys: str = "") -> Precompiled | None:
    """The runner's graphs from ``path``, or None where they cannot run here (logged). ``keys``: the name their
    packed layers were keyed by ("": the file's)."""
    rekeyed = _rekey(runner.model, keys or path.stem)
    if rekeyed == "refused":
        logger.info("precompiled graphs of %s: another model in this process holds their layers' keys with other "
                    "weights; compiling here", runner.name)
        return None
    if rekeyed == "shared":
        logger.info("precompiled graphs of %s: the model is loaded twice in this process; its packed layers are "
                    "shared", runner.name)
    try:
        with model_guards.checked_at_load(Entry(runner.model)) as split:
            graphs = Precompiled(runner, path.read_bytes())
    except Exception:
        logger.exception("loading the precompiled graphs of %s failed; compiling here", runner.name)
        return None
    if split.kept_whole:
        logger.info("%d of %d precompiled graphs of %s do not fit the model as loaded: they will not run",
                    split.kept_whole, split.graphs, runner.name)
    # Precompiled checks a graph's guards to pick it, and torch's own call checked them all again: every
    # forward, target and draft alike (batch-1 agentic turns: 1.11x tokens/s in process, on 2 CPU cores). Set here,
    # not in aot_graphs, whose text keys the graph files (a change there would leave the shipped ones stale).
    wrapped = 0
    for candidates in graphs.graphs.values():
        for fn in candidates:
            if hasattr(fn, "disable_guard_check"):  # a torch without it checks twice, as before
                fn.disable_guard_check()
            model_guards.check_directly(fn)
            wrapped += not kernel_call.call_kernel_directly(fn)
    if wrapped:
        logger.info("%d of %d precompiled graphs of %s keep AOTAutograd's runtime wrapper (it has work to do there, "
                    "or this torch lays it out otherwise)", wrapped, len(graphs), runner.name)
    return graphs


def _changed(path: Path) -> str:
    """What keeps ``path``'s graphs from running the code this process runs ("" where nothing does)."""
    if not path.is_file():
        return "missing"
    try:
        return stale(path.read_bytes())
    except Exception as exc:  # an unreadable file is compiled again, and replaced
        return f"unreadable ({exc!r})"


def current(path: Path) -> bool:
    """Whether ``path`` holds graphs, traced from the code this process runs (logged where it is stale)."""
    changed = _changed(path)
    if changed and changed != "missing":
        logger.info("the precompiled graphs in %s are stale (%s): compiling them again", path, changed)
    return not changed


def install(runners: Sequence[Any], files: Sequence[Path], k_max: int) -> bool:
    """Every runner's graphs loaded from its file and set to serve, with its prompt graphs where their file is
    current; where one cannot, none is (logged)."""
    t0 = time.perf_counter()
    loaded = [load(r, f) for r, f in zip(runners, files)]
    if any(p is None for p in loaded):
        return False
    for runner, graphs, file in zip(runners, loaded, files):
        assert graphs is not None
        add_prompts(runner, graphs, file.stem, prompt_artifact(runner, k_max))
        runner.compiled.precompiled = graphs
    logger.info("loaded %s precompiled graphs in %.1fs", " + ".join(str(len(p)) for p in loaded if p),
                time.perf_counter() - t0)
    return True


def add_prompts(runner: Any, graphs: Precompiled, keys: str, path: Path) -> None:
    """The prompt graphs in ``path`` (their packed layers keyed by ``keys``, the decode file's) added to
    ``graphs``, where the file is current; else prompt chunks run eagerly, as they did before they had graphs."""
    if _changed(path):
        logger.info("%s: no current prompt graphs (%s); its prompt chunks stay eager until they are compiled (after "
                    "a background compile, or compile_prompt_files, as in make compile-cache)", runner.name, path.name)
        return
    prompts = load(runner, path, keys)
    if prompts is not None:
        for shape, fns in prompts.graphs.items():  # new lists: a serving thread may be reading the old ones
            graphs.graphs[shape] = [*graphs.graphs.get(shape, ()), *fns]
        logger.info("%s: %d prompt graphs loaded beside its decode graphs", runner.name, len(prompts))


def compile_prompts(runners: Sequence[Any], k_max: int, dtype: str, trust_remote_code: bool) -> list[Path]:
    """Each runner's prompt graphs compiled in a child (the target's first) where their file is not current;
    waits for it and returns the files. A server loads them at its next start (recipe.compile_cache ships them)."""
    files = [prompt_artifact(r, k_max) for r in runners]
    with one_at_a_time(files, _changed):  # another server's compile of the same files first, then what it left
        missing = [Model(r.name, dtype, trust_remote_code, str(f), draft=i > 0, prompts=True,
                         keys=artifact(r, k_max).stem) for i, (r, f) in enumerate(zip(runners, files)) if _changed(f)]
        if missing and (tail := _wait(spawn(missing, k_max, runners[0].cache.block_size))):
            raise RuntimeError(f"compiling the prompt graphs failed: {tail}")
    return files


def compile_prompt_files(paths: Sequence[str], dtype: str, k_max: int, block_size: int,
                         trust_remote_code: bool = False) -> list[Path]:
    """``compile_prompts`` for the checkpoints at ``paths`` (a target, then its draft), keyed as a server's."""
    from engine.worker.model_runner import ModelRunner

    runners = [ModelRunner.load(path, dtype, "cpu", trust_remote_code) for path in paths]
    for runner in runners:
        runner.allocate_cache(1, block_size)
    return compile_prompts(runners, k_max, dtype, trust_remote_code)


def _wait(child: subprocess.Popen[bytes]) -> str:
    """Waits for a compile child, its progress in this log; "" where it succeeded, else what it said last."""
    assert child.stderr is not None
    tail: collections.deque[str] = collections.deque(maxlen=5)
    for raw in child.stderr:
        line = raw.decode(errors="replace").rstrip()
        tail.append(line)
        if PROGRESS in line:
            logger.info("compile process: %s", line.split(PROGRESS, 1)[1])
    return "" if child.wait() == 0 else f"exit code {child.returncode}: " + " | ".join(tail)


def at_start(runners: Sequence[Any], k_max: int) -> bool:
    """Where every runner has current graphs on disk (shipped with the model, or an earlier start's), loads them
    before the server answers, and returns True: it then serves compiled from its first request. Loaded in the
    background thread while serving instead, the load (5 s for the embedded pair when idle) took 27 s under
    load, and the first 30 s served at 0.75x eager (docs/performance.md#compiling)."""
    files = [artifact(r, k_max) for r in runners]
    return all(not _changed(f) for f in files) and install(runners, files, k_max)


def spawn(models: Sequence[Model], k_max: int, block_size: int) -> subprocess.Popen[bytes]:
    """The child that compiles ``models``, at the lowest CPU priority."""
    # The server's thread count: a graph's guards check it (dynamo's global state), and at nice 19 the child's
    # threads take only what the server leaves.
    spec = {"models": [dataclasses.asdict(m) for m in models], "k_max": k_max, "block_size": block_size,
            "threads": torch.get_num_threads()}
    path = os.pathsep.join(p for p in (str(ENGINE_ROOT.parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONPATH": path}  # from any directory
    # In the server's session: Linux shares the CPU fairly between sessions (autogroups) whatever their nice
    # values, and a child of its own session took half the cores from the server (9 tok/s instead of 190).
    return subprocess.Popen([sys.executable, "-m", "engine.worker.precompile", json.dumps(spec)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def background(runners: Sequence[Any], k_max: int, dtype: str, trust_remote_code: bool) -> Callable[[], bool]:
    """A job for a background warm-up (engine.worker.compiled.BackgroundWarmUp): the runners' graphs (the target's
    first, then its draft models') compiled by a child where their files are missing, then loaded and installed.
    Returns whether every runner got its graphs; where not, nothing is installed."""

    def run() -> bool:
        files = [artifact(r, k_max) for r in runners]
        with one_at_a_time(files, _changed):  # another server's compile of the same files first, then what it left
            missing = [Model(r.name, dtype, trust_remote_code, str(f), draft=i > 0)
                       for i, (r, f) in enumerate(zip(runners, files)) if not current(f)]
            if missing:
                t0 = time.perf_counter()
                logger.info("compile: compiling %s in a child process", " and ".join(m.path for m in missing))
                if failed := _wait(spawn(missing, k_max, runners[0].cache.block_size)):
                    logger.warning("the compile process failed (%s); compiling here instead", failed)
                    return False
                logger.info("compile process done in %.1fs", time.perf_counter() - t0)
        return install(runners, files, k_max)

    return run


@contextlib.contextmanager
def layouts(m: Model) -> Iterator[None]:
    """compile_runner on the prompt layouts (engine.worker.prompt_layouts) or the warm-up ones, a draft's those that
    return at most one logits row a sequence. Chosen here, not in aot_graphs or warm_up_layouts, whose text keys the
    graph files (a change there would leave the shipped ones stale); a draft's file built either way serves alike."""
    every = aot_graphs.warm_up_layouts
    chosen = prompt_layouts if m.prompts else every
    aot_graphs.warm_up_layouts = (lambda *args: [b for b in chosen(*args) if max(b.logits_rows) <= 1]) \
        if m.draft else chosen
    try:
        yield
    finally:
        aot_graphs.warm_up_layouts = every


def main(spec: dict[str, Any]) -> None:
    from engine.worker.model_runner import ModelRunner

    os.setpriority(os.PRIO_PROCESS, 0, 19)  # the server's requests first; the compile gets what they leave
    torch.set_num_threads(spec["threads"])
    tag_caches()
    parent = os.getppid()

    def watch() -> None:  # a server gone (killed, or stopped before the compile was done) ends the compile
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    k_max, block_size = spec["k_max"], spec["block_size"]
    for m in (Model(**m) for m in spec["models"]):
        runner = ModelRunner.load(m.path, m.dtype, "cpu", m.trust_remote_code)
        runner.allocate_cache(3 * max(warm_up_blocks(k_max, block_size), prompt_blocks(k_max, block_size)),
                              block_size)
        # The packed layers' keys: the file's, like a clone's (a prompt file's: its decode file's, loaded beside it).
        small_linear.install(runner.model, m.keys or Path(m.file).stem)
        with layouts(m):
            data = compile_runner(runner, k_max)
        out = Path(m.file)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, out)  # whole or not at all, for a server reading it


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # Through the module's own name: the files name the classes they hold (Entry) by module, and __main__ is no
    # module the server can import.
    importlib.import_module("engine.worker.precompile").main(json.loads(sys.argv[1]))
