/* sekv-native: SeKV's mixed-resolution memory and decode step on llama.cpp's loader and ggml kernels.
 *
 * A new C API next to llama.h (whose structs stay untouched): load a GGUF model, create a SeKV memory
 * sized for one document, import the memory the torch engine built (exact rows, span summaries, span
 * SVD factors), decode one token at a time, and report device- and host-tier bytes of the real buffers.
 *
 * Tensor arguments are row-major C arrays of IEEE half floats (uint16_t) unless said otherwise.
 * KV = KV heads, D = head dim, S = spans, l = span_rows, R = rank.
 * Every function that can fail returns 0 on success and -1 on failure; sekv_last_error() says why.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(SEKV_NATIVE_BUILD)
#define SEKV_API __attribute__((visibility("default")))
#else
#define SEKV_API
#endif

typedef struct sekv_model sekv_model;
typedef struct sekv_memory sekv_memory;
typedef struct sekv_host_rows sekv_host_rows;

typedef struct sekv_model_info {
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;
    int32_t n_embd;
    int32_t n_vocab;
    int32_t n_ctx_train;
    int32_t sliding_window; /* keys a sliding-window (local) layer's query sees, itself included; 0: no such layers */
} sekv_model_info;

typedef struct sekv_memory_params {
    int32_t exact_capacity; /* exact rows per layer: anchors, pending rows and every token decoded later */
    int32_t n_spans;        /* S */
    int32_t span_rows;      /* l: rows of a span slot (the longest span) */
    int32_t rank;           /* R: factor columns of a factored span (the largest stored rank) */
    int32_t zoom_k;         /* spans rebuilt per layer and KV head per step (hard top-k) */
    float summary_bias;     /* multiplier of +log|S| on unexpanded spans' summary rows (0 = leave them out) */
    const int32_t * n_factored; /* [n_layer][2]: spans each layer stores as SVD factors, keys then values
                                   (0 for a sliding-window layer: it keeps its window exactly, no spans) */
    const int32_t * n_raw;      /* [n_layer][2]: spans stored raw (factors would not be smaller than the span) */
    int32_t scheduler;          /* 1: run steps through ggml's multi-backend scheduler even on a CPU-only model
                                   (the path a GPU model always takes; lets CPU tests cover it) */
    int32_t router;             /* 0: route by each span's coarse attention logit + log|S| (training-free);
                                   1: the model's learned router (sekv_model_set_router or the GGUF's sekv.*):
                                   sigmoid(q'.k'/sqrt(d') + log|S|) against per-head thresholds, then top-k;
                                   needs each layer's routing keys (sekv_memory_set_layer_routing);
                                   2: the union: the first ceil(k/2) spans by the training-free rule, the rest
                                   by the learned router among the others */
    const int32_t * n_pinned;   /* [n_layer]: room for pinned rows per layer (question-time selection; see
                                   sekv_memory_set_layer_pins), or nullptr: no pins */
    int32_t host_quant;         /* the host tier's tables (span factors and raw rows): 0 f16; 1 q8_0, 2 q4_0 (blocks of
                                   32 values along each table row, quantized here from the f16 rows handed in;
                                   every table row must then be whole blocks: rank * span_rows % 32 == 0) */
    const sekv_host_rows * host_rows; /* nullptr: the memory allocates its own host tier. Otherwise its spans are
                                   read from these rows, which outlive it (every span raw, n_raw == n_spans,
                                   span_rows and host_quant those of the rows); sekv_memory_set_layer_spans then
                                   takes no rows, only summaries */
} sekv_memory_params;

SEKV_API const char * sekv_last_error(void);

/* n values of ggml type `type` at src (whole blocks) -> float dst [n]: ggml's own conversion, which the torch
 * engine uses to read a GGUF's quantized weights (seconds faster than decoding them in numpy). */
SEKV_API int sekv_dequantize(int32_t type, const void * src, float * dst, int64_t n);

SEKV_API sekv_model * sekv_model_load(const char * path, int32_t n_threads);
/* gpu = 1: weights and the device tier on the first GPU of a CUDA build, the host tier in pinned host
 * memory; ops that read the host tier run on the CPU (only the zoomed rows cross to the GPU). */
SEKV_API sekv_model * sekv_model_load_on(const char * path, int32_t n_threads, int32_t gpu);
/* 1 when the model runs on a GPU */
SEKV_API int32_t sekv_model_on_gpu(const sekv_model * model);
SEKV_API void sekv_model_free(sekv_model * model);
SEKV_API void sekv_model_get_info(const sekv_model * model, sekv_model_info * out);
/* 1 when `layer` is a sliding-window layer (Gemma 3's local layers), 0 when global, -1 out of range. A memory
 * keeps a local layer's last sliding_window positions exactly, in a ring of 2 * sliding_window rows (a chunk may
 * add up to sliding_window + 1 rows without overwriting what its own first token still sees); SeKV's spans,
 * pins and routing are the global layers' only. */
SEKV_API int32_t sekv_model_layer_is_local(const sekv_model * model, int32_t layer);

/* SeKV's learned router. Loading a GGUF that carries one (sekv.* metadata, written by the converter) reads
 * it; a malformed one fails the load. routing_dim d'; q_proj float [n_layer][D][d'] maps a pre-RoPE query
 * to routing space; threshold float [n_layer][n_head] are the per-head zoom thresholds (logits).
 * Setting replaces the model's router (memories created before must not decode with another d'). */
SEKV_API int sekv_model_set_router(sekv_model * model, int32_t routing_dim, const float * q_proj,
                                   const float * threshold);
/* d' of the model's learned router; 0 when it has none */
SEKV_API int32_t sekv_model_router_dim(const sekv_model * model);
SEKV_API int sekv_model_get_router(const sekv_model * model, float * q_proj, float * threshold);

/* A host tier of raw span rows that outlives the memories reading it: a document's spans are added as they are
 * made, so a new memory (each question's, each prefill chunk's) borrows them instead of copying the whole tier.
 * Every global layer holds the same spans [0, count), each a slot of span_rows rows (keys rotated at their own
 * positions, values transposed, as sekv_span_rows' raw), in f16 or block-quantized (host_quant as in
 * sekv_memory_params). Room grows by itself; growing, or replacing spans a memory may read, makes every memory
 * made before fail its next step (it would read freed or changed rows) rather than read them. */
SEKV_API sekv_host_rows * sekv_host_rows_create(sekv_model * model, int32_t span_rows, int32_t host_quant);
SEKV_API void sekv_host_rows_free(sekv_host_rows * rows);
/* Room for n_spans spans per layer (allocated now; never less than the spans held). */
SEKV_API int sekv_host_rows_reserve(sekv_host_rows * rows, int32_t n_spans);
/* One global layer's spans [first, first + n): k [n][KV][l][D], v [n][KV][D][l]. first <= the layer's count;
 * spans from first on are replaced, the layer then holds first + n. */
SEKV_API int sekv_host_rows_set(sekv_host_rows * rows, int32_t layer, int32_t first, int32_t n, const uint16_t * k,
                                const uint16_t * v);
/* Spans every global layer holds. */
SEKV_API int32_t sekv_host_rows_count(const sekv_host_rows * rows);
/* Bytes of its buffer (the room allocated, held or not). */
SEKV_API uint64_t sekv_host_rows_bytes(const sekv_host_rows * rows);

SEKV_API sekv_memory * sekv_memory_create(sekv_model * model, const sekv_memory_params * params);
SEKV_API void sekv_memory_free(sekv_memory * memory);

/* Exact rows of one layer: k, v [KV][n_rows][D]; k post-RoPE at each token's own position. */
SEKV_API int sekv_memory_set_exact(sekv_memory * memory, int32_t layer, int32_t n_rows,
                                   const uint16_t * k, const uint16_t * v);
/* Span table shared by all layers: first position and length of each span, int32 [S]. */
SEKV_API int sekv_memory_set_spans(sekv_memory * memory, const int32_t * start, const int32_t * length);

/* How one layer stores the keys (or values) of its spans. is_raw int32 [S]: 1 = stored raw, 0 = as
 * factors; the i-th factored span is u[i], w[i], the i-th raw span raw[i] (in span order).
 * u [n_factored_here][KV][l][R], w [..][KV][D][R] (W transposed): rows = U W;
 * raw [n_raw_here][KV][l][D] for keys (rotated at their own positions by the export), [n_raw_here][KV][D][l] for values (transposed).
 * Rows past a span's length are zero. */
typedef struct sekv_span_rows {
    const int32_t * is_raw;
    const uint16_t * u;
    const uint16_t * w;
    const uint16_t * raw;
} sekv_span_rows;

/* One layer's spans: summaries sum_k, sum_v [KV][S][D] (sum_k post-RoPE at the span centre) and rows (keys and
 * values nullptr for a memory that borrows sekv_host_rows: span s is its row s). */
SEKV_API int sekv_memory_set_layer_spans(sekv_memory * memory, int32_t layer,
                                         const uint16_t * sum_k, const uint16_t * sum_v,
                                         const sekv_span_rows * keys, const sekv_span_rows * values);

/* One layer's routing keys for the learned router: route_k [KV][S][d'], unit norm (k_proj of the
 * pre-RoPE span summary, normalized). Counted in the device tier. */
SEKV_API int sekv_memory_set_layer_routing(sekv_memory * memory, int32_t layer, const uint16_t * route_k);

/* One layer's pinned spans (question-time selection): spans the question attended to, kept at full
 * resolution for its answer. Their rows k, v [KV][n_rows][D] (k post-RoPE at each token's own position) are
 * attended at every step like exact rows; pinned int32 [S] (1 = pinned) takes those spans' summary rows out
 * of the softmax and out of routing, so a step's zoom_k slots go to other spans. n_rows <= n_pinned[layer];
 * a later call replaces the layer's pins. */
SEKV_API int sekv_memory_set_layer_pins(sekv_memory * memory, int32_t layer, int32_t n_rows, const uint16_t * k,
                                        const uint16_t * v, const int32_t * pinned);

/* One token at `position`: appends its K/V to the exact rows of every layer; logits float [n_vocab]. */
SEKV_API int sekv_decode(sekv_memory * memory, int32_t token, int32_t position, float * logits);

/* A prefill chunk: n tokens at positions position .. position + n - 1, after every row the memory holds. Each
 * token attends to the memory as it stands and causally to the chunk's earlier tokens; the chunk makes one
 * zoom choice per layer and KV head (the most any of its tokens' query heads gives a span, as the torch
 * engine routes a chunk). The chunk's rows are appended to every layer's exact rows (read them back with
 * sekv_memory_get_exact). nll float [n - 1]: -log p(tokens[i + 1] | up to tokens[i]), computed without a
 * [n, n_vocab] buffer (nullptr: not computed), normalised over the vocabulary ids score_rows [n_score_rows]
 * (a shortlist that holds tokens[1..n-1]; n_score_rows 0: the whole vocabulary); logits float [n_vocab]: the
 * last token's. */
SEKV_API int sekv_prefill(sekv_memory * memory, const int32_t * tokens, int32_t n, int32_t position, float * nll,
                          float * logits, const int32_t * score_rows, int32_t n_score_rows);

/* A sliding-window layer's rows for positions [position, position + n_rows): k, v [KV][n_rows][D], k post-RoPE.
 * n_rows <= sliding_window; every local layer must get the same positions before a step. */
SEKV_API int sekv_memory_set_window(sekv_memory * memory, int32_t layer, int32_t position, int32_t n_rows,
                                    const uint16_t * k, const uint16_t * v);
/* A sliding-window layer's rows for positions [position, position + n) while its ring still holds them. */
SEKV_API int sekv_memory_get_window(const sekv_memory * memory, int32_t layer, int32_t position, int32_t n,
                                    uint16_t * k, uint16_t * v);

/* Exact rows [first, first + n) of one layer: k, v [KV][n][D] (k post-RoPE at each token's own position). */
SEKV_API int sekv_memory_get_exact(const sekv_memory * memory, int32_t layer, int32_t first, int32_t n, uint16_t * k,
                                   uint16_t * v);

SEKV_API int32_t sekv_memory_n_exact(const sekv_memory * memory);
/* device: the persistent device-tier buffer; host: span factors; compute: the step's graph buffer
 * (activations plus the zoom working set) as allocated by the last decode. */
SEKV_API int sekv_memory_bytes(const sekv_memory * memory, uint64_t * device, uint64_t * host, uint64_t * compute);
/* Spans rebuilt by `layer` in the last decode step: int32 [KV][k] written to spans, -1 where the learned
 * router passed fewer than k spans over its thresholds; returns k (0: none). k is the layer's own: zoom_k,
 * or fewer where pinned spans leave fewer to route. */
SEKV_API int32_t sekv_memory_last_zoom(const sekv_memory * memory, int32_t layer, int32_t * spans);

/* Stock llama.cpp on the same model, for comparison: a full-f16-KV context, n_context ordinary tokens
 * prefilled in batches of 2048, then n_decode single-token steps; tokens/s of each. flash_attn: -1 =
 * llama.cpp's default (auto), 0 = off, 1 = on. */
SEKV_API int sekv_stock_bench(sekv_model * model, int32_t n_context, int32_t n_decode, int32_t flash_attn,
                              double * prefill_tps, double * decode_tps);

#ifdef __cplusplus
}
#endif
