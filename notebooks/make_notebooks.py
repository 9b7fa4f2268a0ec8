"""Regenerate the notebooks from this script (kept so that their source is reviewable).

Run: ``python notebooks/make_notebooks.py``. The notebooks are stored without outputs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def write(name: str, cells: list) -> None:
    # Cell ids from the cells' text (not random), so that regenerating changes only the
    # notebooks, and the cells, whose text changed.
    seen: set[str] = set()
    for cell in cells:
        base = hashlib.sha1(f"{cell.cell_type}\n{cell.source}".encode()).hexdigest()[:8]
        cell.id, n = base, 1
        while cell.id in seen:  # the same text twice in one notebook
            n += 1
            cell.id = f"{base}-{n}"
        seen.add(cell.id)
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
    })
    nbformat.write(nb, HERE / name)


md, code = new_markdown_cell, new_code_cell

write("01_quickstart.ipynb", [
    md("# gpudash quick start\n\n"
       "gpudash runs TensorFlow's BFC allocator in Python and shows it live. `%gpudash` opens "
       "a dashboard on the default session: a real GPU when CUDA is usable, otherwise a "
       "simulated 16 GiB device (it says so once)."),
    code("%load_ext gpudash"),
    code("%gpudash --fraction 0.5 --growth"),
    md("The session behind the dashboard. Its allocator is named like TensorFlow's "
       "(`GPU_0_bfc`) and its limit is `fraction x total`, as TensorFlow computes it."),
    code("import gpudash\n"
         "sess = gpudash.default_session()\n"
         "dev = sess.devices[0]\n"
         "print(dev, dev.allocator)"),
    md("Settings can also change from code (or with `%gpudash_config`). Lowering the fraction "
       "returns wholly free regions; memory in use is never moved."),
    code("%gpudash_config fraction=0.3"),
    code("print(f\"limit {dev.memory_limit:,} bytes, pool {dev.allocator.pool_bytes:,} bytes, \"\n"
         "      f\"over limit: {dev.over_limit}\")"),
    md("`%%gpudash_track` records one cell and summarises it."),
    code("%%gpudash_track\n"
         "ptrs = [sess.allocate(8 << 20) for _ in range(16)]\n"
         "for p in ptrs[::2]:\n"
         "    sess.free(p)      # deferred deletion, as TensorFlow's EventMgr\n"
         "sess.flush()          # hand the queued frees to the allocator now"),
    md("TensorFlow's own memory log of the allocator, as it would print on an out-of-memory "
       "error: a line per bin, the chunks region by region, the chunks in use by size and the "
       "statistics. The empty bins are left out here (`print(dev.allocator.dump_memory_log())` "
       "prints every line):"),
    code("log = dev.allocator.dump_memory_log().splitlines()\n"
         "shown = [line for line in log if 'Total Chunks: 0,' not in line]  # not the empty bins\n"
         "print('\\n'.join(shown[:40]))\n"
         "if len(shown) > 40:\n"
         "    print(f'... and {len(shown) - 40} more lines')"),
    md("## A workload, live\n\n"
       "A training loop runs **in the background** for about 15 s, and the dashboard at the top "
       "draws it as it runs. Drag its fraction slider meanwhile: the limit changes on the live "
       "session, and below what the loop holds its allocations fail (out-of-memory marks on the "
       "timeline; the loop counts them and goes on).\n\n"
       "Why in the background: while a cell runs, the kernel handles no widget messages, so a "
       "cell that waited for the loop would freeze the dashboard until the loop ended (under "
       "*Run All* the dashboard would not even draw). This cell returns at once; its status "
       "line says when the loop is done, and **Cancel** stops it."),
    code("from gpudash.workloads import training_loop_calls, run_workload\n"
         "\n"
         "def workload(stop_event=None):\n"
         "    calls = training_loop_calls(steps=30, layers=12, batch=64, hidden=4096)\n"
         "    return run_workload(calls, sess.allocate, sess.free, sleep=0.002,\n"
         "                        stop=stop_event.is_set if stop_event else None)\n"
         "\n"
         "task = gpudash.run_in_background(workload)\n"
         "task.widget()"),
    md("What the loop did, once it is done. This cell does not wait for it (`task.result()` "
       "would, and the dashboard with it): run it again when the status line says *done*."),
    code("if task.done:\n"
         "    print(task.result())\n"
         "    print(sess.stats(0))\n"
         "else:\n"
         "    print(f'{task}: still running; run this cell again when it is done')"),
])

write("02_tuning_fraction.ipynb", [
    md("# What fraction would this need?\n\n"
       "Replay a recorded allocation trace through gpudash's BFC allocator under other "
       "settings. Traces can come from gpudash itself, TensorFlow's verbose allocator log, "
       "PyTorch memory snapshots, RAPIDS RMM logs or CuPy's `DebugPrintHook`."),
    code("import gpudash\n"
         "from pathlib import Path\n"
         "from gpudash.trace import load_trace\n"
         "\n"
         "samples = gpudash.samples.path('training').parent  # in the package: works from a wheel\n"
         "trace = load_trace(samples / 'training.gdtrace')\n"
         "trace"),
    code("from gpudash.trace.replay import replay\n"
         "\n"
         "result = replay(trace, device_bytes='16GiB', fraction=0.05)\n"
         "result"),
    md("The smallest fraction, to 0.5 %, at which the trace runs without running out of "
       "memory, and a sweep over fractions with and without growth:"),
    code("from gpudash.trace.whatif import min_fraction, sweep\n"
         "\n"
         "best = min_fraction(trace, '16GiB', allow_growth=True)\n"
         "print(f'smallest fraction: {best.fraction:.3f} ({best.limit_bytes:,} bytes)')"),
    code("table = sweep(trace, fractions=(0.02, 0.05, 0.1, 0.2, 0.5), allow_growth=(True, False),\n"
         "              device_bytes='16GiB', jobs=1)\n"
         "print(table.to_text())"),
    md("Interactively: the what-if view replays the trace when the slider is released and "
       "marks where it runs out of memory."),
    code("from gpudash.widgets import WhatIfView\n"
         "\n"
         "view = WhatIfView(trace, device_bytes='16GiB')\n"
         "view"),
])

write("03_fragmentation.ipynb", [
    md("# Fragmentation: heatmap and chunk map\n\n"
       "A workload that interleaves small and large allocations and frees them out of order "
       "leaves holes. The heatmap shows, for each address range (rows) over time (columns), "
       "the fraction of bytes in use."),
    code("import gpudash\n"
         "from gpudash.workloads import fragmentation_stress, training_loop\n"
         "from gpudash.trace.replay import replay\n"
         "from gpudash.analysis import heatmap, chunk_map_at_peak\n"
         "\n"
         "frag = fragmentation_stress(rounds=1500, seed=1)\n"
         "train = training_loop(steps=6, layers=8, hidden=2048)\n"
         "r_frag = replay(frag, device_bytes='16GiB', fraction=0.5)\n"
         "r_train = replay(train, device_bytes='16GiB', fraction=0.5)\n"
         "print(f'worst external fragmentation: stress {r_frag.worst_fragmentation:.1%}, '\n"
         "      f'training {r_train.worst_fragmentation:.1%}')"),
    code("from gpudash.report import heatmap_figure, chunkmap_figure, bins_figure\n"
         "\n"
         "hm = heatmap(r_frag.recording, rows=256, cols=400)\n"
         "heatmap_figure(hm.values, hm.row_edges, hm.col_edges)"),
    code("peak = chunk_map_at_peak(r_frag.recording)\n"
         "chunkmap_figure(peak, title='Chunk map at the peak')"),
    code("bins_figure(peak)"),
    md("The same views live, on a session: the stress workload runs in the background, one "
       "call every 2 ms (about 15 s), and the chunk map and heatmap fill in as it runs. "
       "Nothing below waits for it, so the dashboard draws at once, also under *Run All*."),
    code("from gpudash.workloads import fragmentation_stress_calls, run_workload\n"
         "from gpudash.widgets import Dashboard\n"
         "\n"
         "sess = gpudash.Session(gpudash.ConfigProto(allow_soft_placement=True), simulate='4GiB')\n"
         "dash = Dashboard(sess, views=('stats', 'heatmap', 'chunkmap'))\n"
         "\n"
         "def stress(stop_event):\n"
         "    return run_workload(fragmentation_stress_calls(rounds=800, seed=2), sess.allocate,\n"
         "                        sess.free_now, sleep=0.002, stop=stop_event.is_set)\n"
         "\n"
         "task = gpudash.run_in_background(stress)\n"
         "display(task.widget())  # its status, and Cancel\n"
         "dash"),
    md("What the workload did, once it is done (this cell does not wait: run it again when the "
       "status line says *done*):"),
    code("if task.done:\n"
         "    print(task.result())\n"
         "    print(sess.stats(0))\n"
         "else:\n"
         "    print(f'{task}: still running; run this cell again when it is done')"),
    md("The dashboard stays live: allocate on `sess` and it follows. When you are done, "
       "`dash.close()` stops its refresher (the figures stay as drawn) and `sess.close()` ends "
       "the session."),
])
write("06_postmortem.ipynb", [
    md("# After an out-of-memory error: explain it, and who held the memory\n\n"
       "What you have after a TensorFlow or JAX job failed is a log with the allocator's dump, "
       "a `TF_BFC_MEMORY_DUMP` file or a profile (`*.xplane.pb`). gpudash reads them without "
       "TensorFlow. The files here are real ones, made by TensorFlow 2.21, that ship with gpudash "
       "(`gpudash.samples`)."),
    code("import gpudash\n"
         "from gpudash import samples\n"
         "from gpudash.trace import load_trace, replay, top_holders\n"
         "\n"
         "e = gpudash.explain(samples.path('tf_oom_mixed.log'), device='16GiB')\n"
         "print(e)"),
    md("In a notebook the explanation also shows the chunk map and the bins at the failure."),
    code("e"),
    md("A fragmentation error: more bytes are free than were asked for, but in pieces."),
    code("print(gpudash.explain(samples.path('tf_oom_fragment.log')))"),
    md("## A profile\n\n"
       "`load_trace` reads `*.xplane.pb` files and TensorBoard log directories. Memory in use "
       "before the profile began is part of the trace, so peaks equal TensorFlow's."),
    code("t = load_trace(samples.path('tf_mlp_training.xplane.pb'))\n"
         "s = t.summary()\n"
         "print(s['allocations'], 'allocations,', s['frees'], 'frees, peak', "
         "s['peak_allocated_bytes'], 'bytes')\n"
         "for h in top_holders(t, at='peak', limit=5):\n"
         "    print(h)"),
    code("r = replay(t, memory_limit='12MiB')\n"
         "r"),
])
write("05_frameworks.ipynb", [
    md("# Frameworks: JAX's settings, and TensorFlow watched live\n\n"
       "TensorFlow and JAX run the same BFC allocator with different knobs. gpudash speaks "
       "both (`Session.from_env`), and watches a real framework's allocator while it runs "
       "(`gpudash.watch`, or `%gpudash --watch tensorflow|jax|torch`). Watching is read-only: "
       "the framework fixes its settings when it starts, so the dashboard's controls are off and "
       "a button prints the settings to restart with.\n\n"
       "This notebook needs `tensorflow-cpu` (`pip install -e '.[tf]'`). Without a GPU it "
       "watches TensorFlow's CPU allocator, which is a BFC when `TF_CPU_ALLOCATOR_USE_BFC=true` "
       "is set before TensorFlow starts."),
    code("%env TF_CPU_ALLOCATOR_USE_BFC=true\n"
         "%env TF_CPP_MIN_LOG_LEVEL=2"),
    md("## JAX's settings\n\n"
       "`XLA_PYTHON_CLIENT_MEM_FRACTION` is a fraction of *total* memory (default 0.75) and "
       "`XLA_PYTHON_CLIENT_PREALLOCATE=false` means growth; garbage collection is off. A session "
       "built from them behaves as JAX's allocator would (simulated here)."),
    code("import gpudash\n"
         "from gpudash.options import framework_settings_text\n"
         "\n"
         "jax_sess = gpudash.Session.from_env(\"jax\", simulate=\"16GiB\", environ={\n"
         "    \"XLA_PYTHON_CLIENT_MEM_FRACTION\": \"0.5\", \"XLA_PYTHON_CLIENT_PREALLOCATE\": \"false\"})\n"
         "dev = jax_sess.devices[0]\n"
         "print(framework_settings_text(\"jax\", dev.options.per_process_gpu_memory_fraction,\n"
         "                              dev.allocator.allow_growth, dev.memory_limit))\n"
         "jax_sess.close()"),
    md("## TensorFlow, watched live\n\n"
       "`gpudash.watch` polls `tf.config.experimental.get_memory_info` four times a second in a "
       "thread of its own; its dashboard shows the timeline and stats (TensorFlow reports bytes "
       "in use and their peak, no layout: the chunk map says so). `%gpudash --watch tensorflow "
       "--device CPU:0` does the same in one line."),
    code("import tensorflow as tf\n"
         "\n"
         "mon = gpudash.watch(\"tensorflow\", devices=[\"CPU:0\"])\n"
         "dash = mon.dashboard()\n"
         "dash"),
    md("A small Keras model trains in the background (so the notebook stays responsive); "
       "watch the timeline follow TensorFlow's own figures."),
    code("def train(stop_event=None):\n"
         "    model = tf.keras.Sequential([tf.keras.Input((512,)),\n"
         "                                 tf.keras.layers.Dense(1024, activation=\"relu\"),\n"
         "                                 tf.keras.layers.Dense(1024, activation=\"relu\"),\n"
         "                                 tf.keras.layers.Dense(10)])\n"
         "    model.compile(optimizer=\"adam\",\n"
         "                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n"
         "    x = tf.random.normal((8192, 512))\n"
         "    y = tf.random.uniform((8192,), maxval=10, dtype=tf.int32)\n"
         "    epochs = 0\n"
         "    while epochs < 6 and not (stop_event is not None and stop_event.is_set()):\n"
         "        model.fit(x, y, batch_size=256, epochs=1, verbose=0)\n"
         "        epochs += 1\n"
         "    return epochs\n"
         "\n"
         "task = gpudash.run_in_background(train)\n"
         "task.widget()"),
    md("What the monitor saw, once the training is done (this cell does not wait for it: "
       "run it again when the status line says *done*):"),
    code("if task.done:\n"
         "    print(task.result(), \"epochs\")\n"
         "    dash.refresh()\n"
         "    state = dash.model.state(0)\n"
         "    print(f\"peak in use {state.stats.peak_bytes_in_use:,} bytes over \"\n"
         "          f\"{len(state.timeline['time_ms'])} samples\")\n"
         "else:\n"
         "    print(f\"{task}: still running; run this cell again when it is done\")"),
    md("The settings to restart with (the dashboard's button prints the same):"),
    code("print(\"\\n\".join(mon.restart_lines(fraction=0.5, allow_growth=True)))"),
    md("Closing the dashboard stops the monitor: `dash.close()`."),
])
write("07_pytorch.ipynb", [
    md("# PyTorch's caching allocator: replay, explain, what would fit\n\n"
       "PyTorch's memory snapshot (`torch.cuda.memory._record_memory_history()` then "
       "`torch.cuda.memory._dump_snapshot('oom.pickle')`, for example in the job's "
       "out-of-memory handler) records every decision its caching allocator made. gpudash "
       "replays it through its model of that allocator, checks every decision, explains the "
       "failure, and answers *what would fit* in PyTorch's own settings.\n\n"
       "This notebook needs no GPU. The snapshots below are written by gpudash's model "
       "(`caching_snapshot`: the same layout PyTorch writes) for a fine-tuning job whose "
       "sequence length changes every step: once on an 80 GiB GPU, where it ran, and once on "
       "a 24 GiB GPU, where it failed."),
    code("import pickle, tempfile\n"
         "from pathlib import Path\n"
         "\n"
         "import gpudash\n"
         "from gpudash.trace.replay import replay\n"
         "from gpudash.formats.torch_snapshot import load_torch_snapshot\n"
         "from gpudash.trace.whatif import min_fraction, sweep\n"
         "from gpudash.workloads import caching_snapshot, finetune_calls\n"
         "\n"
         "folder = tempfile.TemporaryDirectory()\n"
         "paths = {}\n"
         "for gib in (80, 24):\n"
         "    paths[gib] = Path(folder.name) / f'finetune_{gib}gib.pickle'\n"
         "    paths[gib].write_bytes(pickle.dumps(caching_snapshot(finetune_calls(), "
         "device_bytes=f'{gib}GiB')))\n"
         "print({gib: f'{p.stat().st_size:,} bytes' for gib, p in paths.items()})"),
    md("## Replayed exactly\n\n"
       "With the snapshot's own settings, the replay takes the snapshot's segment addresses "
       "(the driver's choice) and checks every segment event, allocation address and "
       "out-of-memory point, and the final layout. It also says what it assumed: the GPU's "
       "size comes from the `oom` entry here, and the rules from the oldest PyTorch that "
       "writes these fields."),
    code("oom = load_torch_snapshot(paths[24])\n"
         "r = replay(oom)\n"
         "print(r)\n"
         "print(r.fidelity.summary())\n"
         "for note in r.assumed + r.warnings:\n"
         "    print('-', note)"),
    md("## Why it failed, and what would have served it\n\n"
       "`gpudash.explain` replays to the failure and shows PyTorch's state at that moment: "
       "the segments and their blocks, the pools, the message PyTorch printed (rebuilt), and "
       "each suggested setting proven by replaying the recorded calls under it."),
    code("e = gpudash.explain(paths[24])\n"
         "print(e)"),
    code("e"),
    md("## What would fit on the 24 GiB GPU?\n\n"
       "The job that ran on 80 GiB, asked about a 24 GiB GPU: the smallest "
       "`torch.cuda.set_per_process_memory_fraction`, with PyTorch's defaults and with "
       "`expandable_segments:True`, and the lines to paste."),
    code("ran = load_torch_snapshot(paths[80])\n"
         "default = min_fraction(ran, '24GiB')\n"
         "expandable = min_fraction(ran, '24GiB', expandable_segments=True)\n"
         "print('defaults:', default)\n"
         "print('expandable segments:', expandable)\n"
         "print()\n"
         "print('\\n'.join(expandable.paste_lines()))"),
    md("PyTorch's defaults do not fit on 24 GiB at any fraction: the sequence lengths change "
       "every step, and the segments cut for one step's activations are the wrong sizes for "
       "the next. Expandable segments grow one segment instead. The table crosses more "
       "settings; `max_split_size_mb` with expandable segments is a combination PyTorch "
       "itself refuses (an internal assert), and the table says so."),
    code("table = sweep(ran, [0.9, 0.95, 1.0], device_bytes='24GiB',\n"
         "              vary={'max_split_size_mb': [None, 256]})\n"
         "print(table.to_text())"),
    md("The same trace can be asked under the other framework's allocator, in its words: "
       "here TensorFlow's BFC, as a JAX or TensorFlow job with the same allocations would run "
       "it."),
    code("bfc = min_fraction(ran, '24GiB', allocator='bfc')\n"
         "print(bfc)\n"
         "print('\\n'.join(bfc.paste_lines('jax')))"),
    md("## Live, on PyTorch's model\n\n"
       "`%gpudash --allocator torch` opens the dashboard on a session that runs PyTorch's "
       "caching allocator (here on a simulated 24 GiB GPU): the segment map with each "
       "segment's pool, the two pools, allocated and reserved over time. The fine-tuning job "
       "runs in the background for about 20 s: turn `expandable_segments` on, move the "
       "fraction or empty the cache while it runs, and watch the segments change; each control "
       "answers with the line that does the same in PyTorch."),
    code("%load_ext gpudash"),
    code("%gpudash --allocator torch --simulate 24GiB"),
    code("from gpudash.workloads import run_workload\n"
         "\n"
         "sess = gpudash.default_session()\n"
         "\n"
         "def job(stop_event=None):\n"
         "    return run_workload(finetune_calls(steps=60), sess.allocate, sess.free, "
         "sleep=0.001,\n"
         "                        stop=stop_event.is_set if stop_event else None)\n"
         "\n"
         "task = gpudash.run_in_background(job)\n"
         "task.widget()"),
    md("The session's settings, in PyTorch's names, can change from code as well "
       "(`sess.configure(expandable_segments=True)`, `sess.empty_cache()`, "
       "`%gpudash_config expandable_segments=True`). Once the job is done, its figures:"),
    code("if task.done:\n"
         "    print(task.result())\n"
         "else:\n"
         "    print(f'{task}: still running; run this cell again when it is done')\n"
         "print(sess)\n"
         "print({k: v for k, v in sess.devices[0].allocator.memory_stats().items()\n"
         "       if k in ('allocated_bytes.all.peak', 'reserved_bytes.all.peak', 'num_ooms', "
         "'num_alloc_retries')})"),
    md("## Real snapshots\n\n"
       "When `../shared/reference/external/` is present (real snapshots from other people's "
       "projects), each one is replayed exactly and its fidelity printed; without it this cell "
       "says so."),
    code("from gpudash.trace.torch_replay import from_snapshot, replay_exact\n"
         "from gpudash.formats.torch_snapshot import load_torch_snapshot_dict\n"
         "\n"
         "external = Path('..', '..', 'shared', 'reference', 'external').resolve()\n"
         "found = sorted(external.glob('*.p*k*l*')) if external.is_dir() else []\n"
         "for path in found:\n"
         "    for dev, tt in from_snapshot(load_torch_snapshot_dict(path)).items():\n"
         "        print(f'{path.name:48} {replay_exact(tt).summary()}')\n"
         "if not found:\n"
         "    print('no real snapshots here (../shared/reference/external is not present)')"),
    code("folder.cleanup()"),
])
write("08_who_holds_it.ipynb", [
    md("# Who holds the memory\n\n"
       "The first question after an out-of-memory error is *which line of my code holds the "
       "memory?* PyTorch records a call stack with every allocation (in a memory snapshot, "
       "and in a profiler trace recorded with `profile_memory=True, with_stack=True`); gpudash "
       "keeps them (interned: a few bytes an event) and answers by line, stack, "
       "`record_function` range or category, at the peak, at an OOM, at any moment, and "
       "between two moments.\n\n"
       "The data here is real: PyTorch 2.13's profiler trace of four training steps of a small "
       "MLP with Adam, on the CPU (`tests/data/real/record_torch_profile.py` made it; it "
       "ships with gpudash as a sample). The script has a leak on purpose: each step also "
       "computes a validation loss and keeps it in a list, with its graph. No GPU is "
       "needed."),
    code("from pathlib import Path\n"
         "import tempfile\n"
         "\n"
         "import gpudash\n"
         "from gpudash import samples\n"
         "from gpudash.trace import load_trace\n"
         "from gpudash.trace.diff import diff_holders, leaks\n"
         "\n"
         "PROFILE = samples.path('torch_mlp.profile.json.gz')\n"
         "trace = load_trace(PROFILE)\n"
         "print(trace)\n"
         "print(f\"peak allocated: {trace.summary()['peak_allocated_bytes']:,} bytes\")"),
    md("## At the peak, by line\n\n"
       "`top_holders` adds up the blocks live at the peak by the innermost frame of *your* "
       "code (not torch's, not a library's, not C++), and says which rule it used. (A "
       "profile names the line where each function begins; a memory snapshot names the line "
       "that ran.)"),
    code("print(gpudash.top_holders(trace))"),
    md("By whole stack, the training step's blocks and the validation pass's come apart, "
       "though both call `forward`:"),
    code("print(gpudash.top_holders(trace, by='stack', limit=4))"),
    md("## By category and by `record_function` range\n\n"
       "Categories follow the rules of PyTorch's memory profiler and Mosaic, from the stacks "
       "and each block's lifetime; every row says which rule placed its bytes."),
    code("print(gpudash.top_holders(trace, by='category'))\n"
         "print()\n"
         "print(gpudash.top_holders(trace, by='annotation'))"),
    md("## What each step keeps\n\n"
       "`leaks` cuts the run into iterations (here at the end of each `Optimizer.step`, from "
       "the trace's own `record_function` ranges) and lists what one iteration allocated that "
       "is still live at the end of the next. The validation pass's activations are kept in "
       "three of four steps: the leak."),
    code("print(leaks(trace, by='stack'))"),
    md("`diff_holders` compares two moments of a run (or two runs), as lines a person reads:"),
    code("change = diff_holders(trace, at=100, to='end')\n"
         "print(change)\n"
         "change   # the same as a table"),
    md("## The stacks as an icicle\n\n"
       "The outermost frame of your code at the top, each deeper frame below, then the library "
       "code it called into; widths are bytes at the peak. The HTML report "
       "(`gpudash replay TRACE --html`) draws the same, with the holders table and each row's "
       "stack."),
    code("from gpudash.report import stack_icicle_figure\n"
         "\n"
         "stack_icicle_figure(trace)"),
    md("## Under other settings: who would hold it at the OOM\n\n"
       "gpudash replays the same calls through its model of PyTorch's CUDA caching allocator "
       "(`torch_mlp.replayed_snapshot.pickle` is that replay's snapshot, in PyTorch's "
       "layout, with the stacks: memory_viz opens it). On a 9 MiB GPU the run fails; "
       "the replay's recording says who held the memory at the failure."),
    code("from gpudash.trace.replay import replay\n"
         "from gpudash.formats.torch_snapshot import load_torch_snapshot\n"
         "\n"
         "snap = load_torch_snapshot(samples.path('torch_mlp.replayed_snapshot.pickle'))\n"
         "r = replay(snap, device_bytes='9MiB', record=True)\n"
         "print(r)\n"
         "print(gpudash.top_holders(r.recording, at='oom'))"),
    md("## Beside the kernels, in Perfetto\n\n"
       "The memory as counters (allocated, reserved), OOMs as instants and `record_function` "
       "ranges as slices, in Chrome's trace format; `merge=` writes them into the PyTorch "
       "profiler trace itself, aligned on its clock, for ui.perfetto.dev "
       "(`gpudash convert TRACE OUT.json --to perfetto --merge PROFILE.json`)."),
    code("from gpudash.formats.perfetto import write_chrome_trace\n"
         "\n"
         "out = tempfile.TemporaryDirectory()\n"
         "merged = Path(out.name) / 'merged.json.gz'\n"
         "write_chrome_trace(trace, merged, merge=PROFILE)\n"
         "print(f'{merged.name}: {merged.stat().st_size:,} bytes')\n"
         "out.cleanup()"),
])
write("04_cluster.ipynb", [
    md("# gpudash on a Dask cluster\n\n"
       "Every Dask worker gets its own gpudash session (`GpudashPlugin`), and streams what its "
       "allocators do through Dask's own channels: the `\"gpudash\"` event topic and the "
       "workers' heartbeat metrics. Here the cluster is a `LocalCluster` of two worker "
       "processes on simulated 16 GiB devices; the same code runs on a real cluster (see "
       "the end)."),
    code("from dask.distributed import Client, LocalCluster\n"
         "from gpudash.dask import (GpudashPlugin, worker_session, ClusterModel,\n"
         "                          ClusterDashboard, configure_workers, collect_traces)\n"
         "\n"
         "cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,\n"
         "                       dashboard_address=':0')\n"
         "client = Client(cluster)\n"
         "client.register_plugin(GpudashPlugin(config={'allow_growth': True}, "
         "simulate='16GiB'))\n"
         "workers = sorted(client.nthreads())\n"
         "print(f'{len(workers)} workers:', *workers)"),
    md("A `ClusterModel` gathers every worker's stream (and, with `record=True`, the default, "
       "each worker's allocator events, for traces). Create it before the work you want to "
       "record."),
    code("model = ClusterModel(client)\n"
         "model.wait(lambda w: len(w) == 2)\n"
         "model"),
    md("Tasks use their worker's session with `worker_session()`. Each worker runs a small "
       "training workload here; the second one a larger model."),
    code("from gpudash.workloads import training_loop_calls, run_workload\n"
         "\n"
         "def train(steps, hidden):\n"
         "    sess = worker_session()\n"
         "    run = run_workload(training_loop_calls(steps=steps, layers=6, hidden=hidden),\n"
         "                       sess.allocate, sess.free_now)\n"
         "    return run.allocs, sess.stats(0).peak_bytes_in_use\n"
         "\n"
         "futures = [client.submit(train, 4, h, workers=[w], pure=False)\n"
         "           for w, h in zip(workers, (2048, 4096))]\n"
         "for w, f in zip(workers, futures):\n"
         "    allocs, peak = f.result()\n"
         "    print(f'{w}: {allocs} allocations, peak in use {peak:,} bytes')"),
    md("What the model knows of each worker (within a fraction of a second):"),
    code("model.sync()\n"
         "for address, w in model.workers.items():\n"
         "    print(f\"{address}: in use {w['bytes_in_use']:,} / pool {w['pool_bytes']:,} / \"\n"
         "          f\"limit {w['bytes_limit']:,}, peak {w['peak_bytes_in_use']:,}, \"\n"
         "          f\"{w['events']} events, {w['ooms']} OOMs, {w['state']}\")"),
    md("The cluster dashboard: a row per worker (a sparkline of bytes in use; in use / pool / "
       "limit; fragmentation; OOMs), controls for all workers or one, and the usual views of "
       "a worker picked with its button."),
    code("dash = ClusterDashboard(client)\n"
         "dash"),
    md("Settings change live on every worker (or `workers=[...]`). Values are checked on the "
       "client first, then on every worker, before any worker changes."),
    code("settings = configure_workers(client, per_process_gpu_memory_fraction=0.5)\n"
         "for address, devices in settings.items():\n"
         "    print(f\"{address}: limit {devices[0]['limit']:,} bytes\")"),
    code("import gpudash\n"
         "\n"
         "try:\n"
         "    configure_workers(client, per_process_gpu_memory_fraction=1.5)\n"
         "except gpudash.ConfigError as exc:\n"
         "    print('refused:', exc)"),
    md("One multi-device trace of the run, one device per worker (a worker that died keeps "
       "what it had sent), then what-if replays of one worker's trace as Dask tasks:"),
    code("import tempfile\n"
         "from pathlib import Path\n"
         "\n"
         "path = Path(tempfile.mkdtemp()) / 'cluster.gdtrace'  # not beside the notebook\n"
         "trace = collect_traces(client, path)\n"
         "for d in trace.meta['devices']:\n"
         "    print(d['index'], d['name'], d['recorded_events'], 'events')"),
    code("from gpudash.trace.whatif import sweep\n"
         "\n"
         "kw = dict(fractions=(0.01, 0.02, 0.05, 0.1), allow_growth=(True, False),\n"
         "          device_bytes='16GiB', device=1)\n"
         "table = sweep(trace, client=client, **kw)\n"
         "print(table.to_text())\n"
         "print('same as local:', table == sweep(trace, **kw))"),
    md("## On a real cluster\n\n"
       "Point the client at the scheduler and register the plugin without `simulate`: each "
       "worker then uses its CUDA GPU (with dask-cuda, one per worker), routes CuPy through "
       "its session (`install=True`), and where RMM is installed makes RMM's current device "
       "resource a callback resource over the session, so cuDF and everything else on RMM is "
       "seen:\n\n"
       "```python\n"
       "client = Client('tcp://scheduler:8786')          # or Client(LocalCUDACluster())\n"
       "client.register_plugin(GpudashPlugin(config={'allow_growth': True}))\n"
       "```\n\n"
       "From a terminal, `gpudash whatif TRACE --scheduler tcp://scheduler:8786` runs the "
       "what-if replays on the cluster.\n\n"
       "When you are done, `dash.close(); model.close(); client.close(); cluster.close()` "
       "(this notebook leaves them open: a closed dashboard stops drawing)."),
])
write("09_live_pytorch.ipynb", [
    md("# A running PyTorch job, live: shadow mode\n\n"
       "`gpudash.torch.attach()` (or `%gpudash --attach torch`) follows the PyTorch job of "
       "this process while it runs: it turns on PyTorch's allocator history (a bounded ring, "
       "with Python stacks), reads the new entries in a thread of its own and feeds them "
       "through gpudash's exact model of PyTorch's caching allocator. The dashboard shows "
       "PyTorch's own segments and blocks, and its controls act on the job: the fraction "
       "calls `torch.cuda.set_per_process_memory_fraction`, the settings go through "
       "PyTorch's settings call, *empty cache* calls `torch.cuda.empty_cache()`. Each "
       "answers with the replay of the run so far under the new setting.\n\n"
       "**Where no GPU is**, this notebook runs on `gpudash.testing.ModelTorch`: a stand-in "
       "for `torch` whose CUDA allocator is gpudash's model of PyTorch's, recording its "
       "history as PyTorch 2.11 does (the ring, the stacks, the settings calls, the "
       "out-of-memory observer). It ships in the package (the tests use the same one), so "
       "this notebook runs from an installed gpudash. **On a CUDA machine** with PyTorch, "
       "the same cells follow real PyTorch."),
    code("import threading\n"
         "import time\n"
         "\n"
         "import gpudash\n"
         "\n"
         "try:\n"
         "    import torch\n"
         "    cuda = torch.cuda.is_available()\n"
         "except ImportError:\n"
         "    cuda = False\n"
         "if cuda:\n"
         "    def new(nbytes):                  # a tensor of nbytes on the GPU\n"
         "        return torch.empty(nbytes, dtype=torch.uint8, device='cuda')\n"
         "\n"
         "    def drop(t):                      # the job lets go of it (the list is cleared)\n"
         "        pass\n"
         "else:\n"
         "    from gpudash.testing import ModelTorch\n"
         "\n"
         "    torch = ModelTorch(total=2 << 30)   # a 2 GiB device, PyTorch 2.11's allocator\n"
         "    new, drop = torch.allocate, torch.free\n"
         "unit = torch.cuda.get_device_properties(0).total_memory // 2048   # 1 MiB of 2 GiB\n"
         "print('following', f'PyTorch {torch.__version__} on CUDA' if cuda else\n"
         "      'the stand-in gpudash.testing.ModelTorch (no GPU here)')"),
    md("Attach, and show the dashboard. Its status line under the figures says how old "
       "the view is (\"history read 0.2 s ago\"): the history is read at most every "
       "0.25 s, and never more than an eighth of one core, however large the ring; the "
       "views go on at their own rate meanwhile."),
    code("shadow = gpudash.torch.attach(torch)\n"
         "dash = shadow.dashboard()\n"
         "dash"),
    md("The job: a training-like loop in a background thread (the kernel stays free, the "
       "dashboard live). Each step allocates six activations, keeps one and frees the rest; "
       "`shadow.step()` marks the steps (a job that annotates `ProfilerStep#N` with the "
       "profiler needs none)."),
    code("def train(steps, first=1):\n"
         "    kept = []\n"
         "    for s in range(first, first + steps):\n"
         "        shadow.step(s)\n"
         "        acts = []\n"
         "        for k in range(6):\n"
         "            acts.append(new(((s - 1) % 5 + 1) * 9 * unit + k * unit))\n"
         "        kept.append(acts.pop(2))\n"
         "        for a in acts:\n"
         "            drop(a)\n"
         "        acts.clear()\n"
         "        time.sleep(0.02)\n"
         "    return kept\n"
         "\n"
         "held = []\n"
         "job = threading.Thread(target=lambda: held.extend(train(12)))\n"
         "job.start(); job.join()\n"
         "shadow.refresh()\n"
         "print(shadow.devices[0].summary())"),
    md("**What if** the fraction were 0.2? The exact replay of the calls recorded so far, "
       "before anything changes: the call that would have failed, its step and the job's "
       "line."),
    code("wi = shadow.what_if(fraction=0.2)\n"
         "print(wi.text)"),
    md("Where no GPU is, the claim can be checked at once: the same job on a fresh "
       "stand-in limited to 0.2 from the start fails at that very call."),
    code("if not cuda:\n"
         "    again = ModelTorch(total=2 << 30, fraction=0.2)\n"
         "    calls = 0\n"
         "    try:\n"
         "        kept = []\n"
         "        for s in range(1, 13):\n"
         "            acts = []\n"
         "            for k in range(6):\n"
         "                calls += 1\n"
         "                acts.append(again.allocate(((s - 1) % 5 + 1) * 9 * unit + k * unit))\n"
         "            kept.append(acts.pop(2))\n"
         "            for a in acts:\n"
         "                calls += 1\n"
         "                again.free(a)\n"
         "    except gpudash.OutOfMemoryError:\n"
         "        print(f'the same job at 0.2 failed at call {calls:,} (step {s}): '\n"
         "              f\"{'as predicted' if (calls, s) == (wi.call, wi.step) else 'NOT as predicted'}\")\n"
         "else:\n"
         "    print('on CUDA: benchmarks/gpu_check_shadow.py checks it against PyTorch itself')"),
    md("On the dashboard the what-if comes before the change: while the fraction slider is "
       "dragged, the status line says what the run so far would have met at the value under "
       "the handle, and nothing is applied until it is let go. The same from code:"),
    code("print(shadow.preview('per_process_gpu_memory_fraction', 0.2))"),
    md("Now drive the fraction from code (letting go of the slider does the same): PyTorch's "
       "own call, reserved before and after, what the new limit refuses, and the what-if "
       "line."),
    code("print(shadow.configure(fraction=0.2))"),
    md("The job goes on under the new limit, and runs out of memory. PyTorch's "
       "out-of-memory observer tells shadow mode at once; the next read explains it: where "
       "(the job's line and step), and the setting that would have served it, proven by "
       "replaying the recorded calls."),
    code("failed = []\n"
         "\n"
         "def more():\n"
         "    try:\n"
         "        held.extend(train(12, first=13))\n"
         "    except Exception as exc:    # torch.OutOfMemoryError (gpudash's on the stand-in)\n"
         "        failed.append(exc)\n"
         "\n"
         "job = threading.Thread(target=more)\n"
         "job.start(); job.join()\n"
         "shadow.refresh()\n"
         "print('the job:', type(failed[0]).__name__ if failed else 'no error')\n"
         "for oom in shadow.ooms:\n"
         "    print(oom.text)"),
    md("The job lets go of what it kept; *empty cache* then returns the cached segments "
       "no block holds. Every control's answer is kept, in PyTorch's words:"),
    code("for t in held:\n"
         "    drop(t)\n"
         "held.clear()\n"
         "shadow.empty_cache()\n"
         "print(shadow.answers[-1])"),
    md("When you are done: `dash.close(); shadow.stop()` (the history recording goes off "
       "again). This notebook leaves them open, so the dashboard above stays live."),
])
print("notebooks written")
