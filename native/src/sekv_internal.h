// Shared between the native sources: the model handle, the memory and its tensors.
#pragma once

#include "sekv_native.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "llama.h"

#include <algorithm>
#include <string>
#include <vector>

struct llama_model;

void sekv_set_error(const std::string & message);

struct sekv_model {
    llama_model * model = nullptr;
    ggml_backend_t cpu = nullptr;  // always: the whole graph on a CPU-only run, the host-tier reads otherwise
    ggml_backend_t gpu = nullptr;  // on a GPU run: weights, device tier and every op that does not read the host tier
    ggml_backend_dev_t gpu_dev = nullptr;
    int32_t n_threads = 1;
    sekv_model_info info{};
    int rope_type = 0;
    float rope_base = 10000.0f;
    float rope_scale = 1.0f;
    int n_ctx_orig = 0;
    float beta_fast = 32.0f;
    float beta_slow = 1.0f;
    float norm_eps = 1e-5f;
    // the layer shape beside llama's (Gemma 3: embeddings times sqrt(n_embd), q/k RMSNorm, post-norms, GELU)
    float embed_scale = 1.0f;
    float q_scale = 1.0f;        // attention logit scale applied to the queries
    float logit_softcap = 0.0f;  // logits -> c tanh(logits / c) when > 0
    bool gelu = false;           // the MLP's gate: GELU (tanh) instead of SiLU
    // sliding-window layers: local[il] = 1; their RoPE base and scale
    std::vector<uint8_t> local;
    float rope_base_swa = 10000.0f;
    float rope_scale_swa = 1.0f;
    // SeKV's learned router (sekv_router.cpp): q_proj^T f32 [D, d', L], per-head thresholds f32 [H, L]
    int32_t router_dim = 0;  // d'; 0: no learned router
    ggml_context * router_ctx = nullptr;
    ggml_backend_buffer_t router_buf = nullptr;
    ggml_tensor * router_q = nullptr, * router_thr = nullptr;
};

// the GGUF's sekv.* router, when it has one (false: present but unusable, error set)
bool sekv_router_from_gguf(sekv_model * model, const char * path);
void sekv_router_free(sekv_model * model);

// One layer of the memory. Device tier: exact rows and span summaries. Host tier: span factors.
//   ek  f16 [D, cap, KV]      exact keys (post-RoPE)        evt f16 [cap, D, KV]  exact values, transposed
//   sk  f16 [D, S, KV]        summary keys (post-RoPE)      svt f16 [S, D, KV]    summary values, transposed
//   uk, uv f16 [R*l, F+1, KV] factored spans' U (l x R)   wk, wv f16 [R*D, F+1, KV] their W^T (D x R)
//   (F and n_raw per layer and per keys / values)
//   rk f16 [D*l, n_raw+1, KV] raw spans' keys (pre-RoPE)   rvt f16 [l*D, n_raw+1, KV] their values, transposed
//   k_fslot, k_rslot, v_fslot, v_rslot i32 [1, S, KV]: each span's slot in the factored / raw table
//   route_k f16 [d', S, KV]  routing keys of the learned router (params.router only)
//   pk f16 [D, P, KV], pvt f16 [P, D, KV]  pinned rows (post-RoPE keys; values transposed), P = n_pinned[il]
//   pin_bias f32 [S, 1, 1]   0, or -inf for a pinned span: added to its summary row's bias and routing score
// A sliding-window layer holds only its ring (device tier): wk_ring, wv_ring f16 [D, C, KV] (keys post-RoPE, values
// as rows), row j holding the position sekv_memory::ring_pos[j].
// The last slot of each table stays zero: a span indexes it in the table it is not stored in.
struct sekv_layer_tensors {
    ggml_tensor * ek = nullptr, * evt = nullptr, * sk = nullptr, * svt = nullptr;
    ggml_tensor * uk = nullptr, * wk = nullptr, * uv = nullptr, * wv = nullptr;
    ggml_tensor * rk = nullptr, * rvt = nullptr;
    ggml_tensor * k_fslot = nullptr, * k_rslot = nullptr, * v_fslot = nullptr, * v_rslot = nullptr;
    ggml_tensor * route_k = nullptr;
    ggml_tensor * pk = nullptr, * pvt = nullptr, * pin_bias = nullptr;
    ggml_tensor * ring_k = nullptr, * ring_v = nullptr;
    bool local = false;
    int32_t window_end = 0;  // a local layer: one past the last position its rows were set for
    int32_t pin_capacity = 0;    // P
    int32_t n_pin_rows = 0;      // pinned rows set now (<= P)
    int32_t n_pinned_spans = 0;  // spans they belong to
    int32_t n_factored[2] = {0, 0};  // keys, values
    int32_t n_raw[2] = {0, 0};
};

// sekv_host_rows (sekv_host_rows.cpp): per global layer rk f16 [D*l, capacity+1, KV] and rvt [l*D, capacity+1, KV]
// (or their block-quantized types), the last slot zero; nullptr for a sliding-window layer.
struct sekv_host_rows {
    sekv_model * model = nullptr;
    int32_t span_rows = 0, host_quant = 0;
    int32_t capacity = 0;
    std::vector<int32_t> count;  // spans each layer holds (0 for a sliding-window layer)
    // bumped when tables move (growth) or held spans are replaced: a memory made at another generation stops
    uint64_t generation = 0;
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    std::vector<ggml_tensor *> rk, rvt;
};

int32_t sekv_host_rows_held(const sekv_host_rows * rows);  // the least count over global layers

// [S][KV][width] f16 -> rows first .. first + S - 1 of a [width, *, KV] table (the span and head axes swapped), each
// row quantized to the table's type where it is not f16
void sekv_set_span_major(ggml_tensor * dst, const uint16_t * src, int64_t first, int64_t S, int64_t KV, int64_t width);

struct sekv_memory {
    sekv_model * model = nullptr;
    sekv_memory_params params{};
    uint64_t host_generation = 0;  // params.host_rows' generation when the memory was made
    int32_t n_exact = 0;  // valid exact rows (the same in every layer)
    std::vector<int32_t> layer_exact;  // rows set per layer by the import (must agree before decoding)
    int32_t ring = 0;                  // C: rows of each sliding-window layer's ring (0: the model has none)
    std::vector<int32_t> ring_pos;     // [C]: the position each ring row holds, -1: empty (the same in every local layer)

    ggml_context * device_ctx = nullptr;
    ggml_context * host_ctx = nullptr;
    ggml_backend_buffer_t device_buf = nullptr;
    ggml_backend_buffer_t host_buf = nullptr;
    std::vector<sekv_layer_tensors> layers;
    // span metadata (device tier): routing bias log|S| [S], coarse-row bias [S],
    // rebuilt-row positions i32 [l, S, KV], rebuilt-row padding mask (0 / -inf) [l, S, KV]
    ggml_tensor * route_bias = nullptr, * coarse_bias = nullptr, * row_pos = nullptr, * row_mask = nullptr;
    ggml_tensor * neg_inf = nullptr;  // [1, zoom_k, KV] filled with -inf: masks the coarse row of a zoomed span
    bool spans_set = false;
    std::vector<bool> layer_spans_set;
    int32_t router_dim = 0;  // d' of the routing keys (params.router): the model's router must still have it
    std::vector<bool> layer_routing_set;

    ggml_gallocr_t allocr = nullptr;        // one backend: plain allocation of each step's graph
    ggml_backend_sched_t sched = nullptr;   // GPU (or forced): ggml splits each step between GPU and CPU
    std::vector<uint8_t> graph_meta;  // scratch for the per-step graph's tensor headers
    std::vector<std::vector<int32_t>> last_zoom;  // [layer][KV * k], -1: a slot the learned router left empty
    std::vector<int32_t> last_zoom_k;             // [layer]: k of that layer's last step
};

// About what the causal mask of one flash-attention call of a chunk may take. The rows it attends to sit beside
// it in the same compute buffer, so a chunk at a 25% budget stays within it (test_native.py).
constexpr int64_t SEKV_BLOCK_BYTES = 4 << 20;
// About what one of the [n_ff, tokens] activations of a chunk's MLP may take (the MLP runs over blocks of tokens).
constexpr int64_t SEKV_MLP_BLOCK_BYTES = 1 << 20;
// Rows a sliding-window layer's ring holds: a chunk of up to window + 1 tokens then overwrites only positions no
// query of it can see.
inline int32_t sekv_ring_rows(int32_t window) { return 2 * window; }

// The host tier's table type for sekv_memory_params.host_quant (0 f16, 1 q8_0, 2 q4_0).
inline ggml_type sekv_host_type(int32_t host_quant) {
    return host_quant == 1 ? GGML_TYPE_Q8_0 : host_quant == 2 ? GGML_TYPE_Q4_0 : GGML_TYPE_F16;
}

// Nodes the graph of T tokens may hold (every layer's ops, a chunk's attention and surprisal in blocks).
size_t sekv_graph_nodes(const sekv_memory * mem, int64_t T, int64_t score_rows = 0);
// Most nodes a graph may hold on the multi-backend scheduler (it sizes its tables once).
constexpr size_t SEKV_SCHED_GRAPH_SIZE = 65536;

// Per layer, what the decode graph zoomed into: the top-k span indices i32 [k, KV] and, with the learned
// router, whether each passed its threshold f32 [1, k, KV] (1 / 0); nullptr where there is none.
struct sekv_zoom_outputs {
    std::vector<ggml_tensor *> chosen;
    std::vector<ggml_tensor *> passed;
};

// Vocabulary rows per block of a chunk's logits when its surprisal is computed: about 2 MiB of logits for the chunk's
// n tokens at a time. Blocks of the vocabulary, not of tokens: the output matrix is read once per chunk (blocks of
// tokens read it once per block, 137 MB a time on Gemma 3's 262K vocabulary).
inline int64_t sekv_nll_rows(int64_t n) { return std::max<int64_t>(64, (int64_t) (512 << 10) / std::max<int64_t>(n, 1) / 64 * 64); }

// A graph's inputs: token ids i32 [T], positions i32 [T], the causal mask of a chunk's own rows f32
// [n_rows, 1, T, 1] (nullptr for one token); with sliding-window layers, the ring rows the tokens are written to
// i32 [T] and which ring rows each token sees f32 [C, 1, T, 1] (0 / -inf); the surprisal targets token[i + 1]
// i32 [T - 1] (nullptr when not asked for) and the vocabulary rows it normalises over i32 [R] (nullptr: all).
struct sekv_graph_inputs {
    ggml_tensor * tokens = nullptr, * pos = nullptr, * causal = nullptr, * nll_index = nullptr, * score_rows = nullptr;
    ggml_tensor * ring_slots = nullptr, * window_mask = nullptr;
};

// The graph of T tokens (a decode step: T = 1; a prefill chunk otherwise): outputs "logits" (the last token's)
// and, with with_nll, "nll" [1, T - 1], normalised over score_rows vocabulary rows (0: all of them).
ggml_cgraph * sekv_build_graph(sekv_memory * mem, ggml_context * ctx, int64_t T, bool with_nll, int64_t score_rows,
                               sekv_graph_inputs & in,
                               sekv_zoom_outputs & zoom);
