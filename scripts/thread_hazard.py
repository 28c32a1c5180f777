"""Decode speed of the embedded default (llama.cpp target, K=0, 256 tokens) when one process asks for steps
from one thread (`main`), from fresh threads (`fresh`), from one pool thread (`persist`), or from the main
thread and then a pool thread (`main_then_persist`: the case GNU OpenMP throttled, docs/serve.md "Threads").
T1=1 sets torch to one thread after loading. Usage: python scripts/thread_hazard.py MODE"""
import statistics, sys, threading, time, os
from concurrent.futures import ThreadPoolExecutor
import edgespec
PROMPT = "Once upon a time, in a small village by the sea, there lived an old lighthouse keeper named"
m = edgespec.load(k=0, progress=lambda s: None)
import torch, os
if os.environ.get("T1"): torch.set_num_threads(1)
def one():
    c = m.generate(PROMPT, max_tokens=256, temperature=0)
    return round(c.metrics.decode_tokens_per_s, 1)
def nthreads(): return len(os.listdir(f"/proc/{os.getpid()}/task"))
mode = sys.argv[1]
print("threads after load", nthreads())
res = []
if mode == "fresh":
    for i in range(5):
        out = []; t = threading.Thread(target=lambda: out.append(one())); t.start(); t.join(); res.append(out[0])
elif mode == "persist":
    ex = ThreadPoolExecutor(1)
    for i in range(5): res.append(ex.submit(one).result())
elif mode == "main_then_persist":
    print("main", one())
    ex = ThreadPoolExecutor(1)
    for i in range(5): res.append(ex.submit(one).result())
elif mode == "main":
    for i in range(5): res.append(one())
print(mode, statistics.median(res), res, "threads", nthreads(), flush=True)
