"""Plain batch-1 decoding speed of whatever llama-cpp-python this Python has (no specdec): run it in two venvs to
compare builds, e.g. specdec install-llama-cpp --amx off (AMX compiled out) against a default `pip install`, in one sitting.

    python benchmarks/bench_plain_decode.py ~/.cache/specdec/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
"""
import sys, time
import numpy as np
import llama_cpp as L
path = sys.argv[1]
L.llama_backend_init()
mp = L.llama_model_default_params(); mp.n_gpu_layers = 0
m = L.llama_model_load_from_file(path.encode(), mp)
cp = L.llama_context_default_params(); cp.n_ctx = 1024; cp.n_batch = 512; cp.n_threads = 2; cp.n_threads_batch = 2
c = L.llama_init_from_model(m, cp)
b = L.llama_batch_init(512, 0, 1)
def decode(tokens, pos0):
    b.n_tokens = len(tokens)
    for i, t in enumerate(tokens):
        b.token[i] = t; b.pos[i] = pos0 + i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1 if i == len(tokens) - 1 else 0
    assert L.llama_decode(c, b) == 0
vocab = L.llama_model_get_vocab(m)
decode(list(range(100, 164)), 0)
rates = []
for rep in range(3):
    pos = 64 + rep * 128
    t0 = time.perf_counter()
    tok = 200
    for i in range(128):
        decode([tok], pos + i)
        logits = np.ctypeslib.as_array(L.llama_get_logits(c), shape=(L.llama_vocab_n_tokens(vocab),))
        tok = int(np.argmax(logits))
    rates.append(128 / (time.perf_counter() - t0))
print(L.__version__, "AMX_INT8 = 1" in L.llama_print_system_info().decode(), "plain tok/s:", [round(r, 1) for r in rates])
