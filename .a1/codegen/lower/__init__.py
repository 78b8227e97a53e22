"""Lowering: every node kind of the pass graphs as a numba.cuda kernel specialised on its constants.

Modules (each kernel's reference is the same-named function in `runtime.reference`):
  cuda        the only import of numba.cuda (the capability shim)
  weights     GGUF tensors repacked into kernel layouts, the same bytes; upload to the device
  word_formats  a packed weight's 32-bit words decoded to float32, per type (what the matmul cores read)
  matmul      dense matmuls (bias fused; a decode window's q, k and v in one launch), SwiGLU gate/up, in the
              prefill and decode families, and the two cores the routed experts run on
  moe         routed experts: pairs grouped by expert (a decode window's top-k, route weights and groups in
              one launch), their gate/up and down, the prefill terms' weighted sum
  kv_pages    the K/V pages: layout (the planner's bytes), element formats, the store (f16, q8_0, q4_0, mixes)
  attention   paged attention over them: the entry point (and the benchmark's earlier kernel);
              attention_prefill and attention_decode the two families' kernels, attention_combine the
              decode splits' merge
  pointwise   embedding, RMSNorm, NEOX RoPE of q and k in one launch (with the per-head RMSNorm before it),
              concat, router top-k and weights (softmax, sigmoid + bias), argmax
  program     a pass graph bound to its kernels, weights, K/V and activation arena, run in order

Conventions every kernel keeps:
  - A factory `make_<op>(constants...)`, cached per process, compiles the kernel once and returns a launch
    function `launch(stream, *device_arrays)`; it never allocates and never synchronises, so a decode step
    can be captured into a CUDA graph and replayed. Scratch comes in as arguments (it lives in the arena).
  - Activations are float32 row-major (rows, features); token ids, positions and expert ids are int32.
  - Arithmetic is float32 (numba widens float32 * python float to float64: constants are wrapped in
    float32()); every output element is reduced in one fixed order, so results never depend on how many
    rows a launch holds:
      prefill family: any chunk size gives bitwise the same per-token results;
      decode family: a window of 1..MAX_WINDOW rows gives bitwise the rows of a window of 1, and the window
      reads each weight once.
  - Warp shuffles only through the shim's `warp_max` and `warp_sum` (fixed order; the simulator, which has no
    shuffles, gets them emulated there); other reductions go through shared memory.
"""

MAX_WINDOW = 8      # rows a decode-family launch holds: a decode step, or a verify window of 1 + 7 drafts
FAMILIES = ("prefill", "decode")
