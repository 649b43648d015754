"""The engine's choices a user names in a setting: decode attentions, the arena's dtypes and windows, and the packed
admission budget's default. Plain Python, no JAX: the command line parses and checks its settings before it imports
JAX."""

# Decode attention: the blocked online-softmax walk, the CPU decode attention kernel (each row's own positions, read in
# place), or jax.nn.dot_product_attention ("xla" or "cudnn") over each lane's whole slab with per-lane lengths (no
# per-block loop; cuDNN skips what lies past a lane's length).
ATTENTIONS = ("blocked", "kernel", "xla", "cudnn")
KV_WINDOWS = ("ring", "full")  # windowed layers keep a ring of their window, or every position (llama.cpp's swa-full)
KV_DTYPES = ("auto", "float32", "bfloat16", "int8")  # auto: the activations' dtype
PACK_BUDGET_AUTO = 128  # rows per packed admission step where packing is on by default (bench/admission.py)
