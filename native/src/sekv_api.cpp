// Running the memory's graph: one decode step or one prefill chunk. Build the graph, allocate its compute
// buffer, run it, read logits (and a chunk's surprisal) and the zoom choices.
#include "sekv_internal.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

static bool ready(const sekv_memory * mem) {
    const sekv_host_rows * shared = mem->params.host_rows;
    if (shared != nullptr && (shared->generation != mem->host_generation ||
                              sekv_host_rows_held(shared) < mem->params.n_spans)) {
        sekv_set_error("the host rows this memory reads were moved or replaced since it was made: make a new memory");
        return false;
    }
    if (!mem->spans_set) {
        sekv_set_error("the span table was never set (sekv_memory_set_spans)");
        return false;
    }
    for (bool done : mem->layer_spans_set) {
        if (!done) {
            sekv_set_error("a layer's spans were never set (sekv_memory_set_layer_spans)");
            return false;
        }
    }
    for (bool done : mem->layer_routing_set) {
        if (!done) {
            sekv_set_error("a layer's routing keys were never set (sekv_memory_set_layer_routing)");
            return false;
        }
    }
    if (mem->params.router && mem->router_dim != mem->model->router_dim) {
        sekv_set_error("the model's router was replaced by one of another routing_dim since this memory was made");
        return false;
    }
    int32_t window_end = -1;
    for (size_t il = 0; il < mem->layers.size(); ++il) {
        if (mem->layers[il].local) {
            if (window_end >= 0 && mem->layers[il].window_end != window_end) {
                sekv_set_error("sliding-window layers hold different positions: set every local layer's window");
                return false;
            }
            window_end = mem->layers[il].window_end;
        } else if (mem->layer_exact[il] != mem->n_exact) {
            sekv_set_error("layers hold different numbers of exact rows: import every layer before decoding");
            return false;
        }
    }
    return true;
}

static void read_zoom(sekv_memory * mem, const sekv_zoom_outputs & zoom) {
    std::vector<float> passed;
    for (size_t il = 0; il < zoom.chosen.size(); ++il) {
        auto & dst = mem->last_zoom[il];
        ggml_tensor * chosen = zoom.chosen[il];
        if (chosen == nullptr) {
            dst.clear();
            mem->last_zoom_k[il] = 0;
            continue;
        }
        dst.resize((size_t) ggml_nelements(chosen));
        ggml_backend_tensor_get(chosen, dst.data(), 0, dst.size() * sizeof(int32_t));
        if (zoom.passed[il] != nullptr) {  // same [k, KV] order as chosen
            passed.resize(dst.size());
            ggml_backend_tensor_get(zoom.passed[il], passed.data(), 0, passed.size() * sizeof(float));
            for (size_t i = 0; i < dst.size(); ++i) {
                if (passed[i] == 0.0f) dst[i] = -1;
            }
        }
        mem->last_zoom_k[il] = (int32_t) chosen->ne[0];
    }
}

// whether every one of ids [n] is a vocabulary row (else the error says `what`)
static bool vocab_ids(const int32_t * ids, int32_t n, int32_t n_vocab, const char * what) {
    for (int32_t i = 0; i < n; ++i) {
        if (ids[i] < 0 || ids[i] >= n_vocab) {
            sekv_set_error(what);
            return false;
        }
    }
    return true;
}

// n tokens at positions position .. position + n - 1; nll: a chunk's surprisal [n - 1] or nullptr, normalised over
// the vocabulary ids score_rows [n_score_rows] (n_score_rows 0: the whole vocabulary)
static int run(sekv_memory * mem, const int32_t * tokens, int32_t n, int32_t position, float * nll, float * logits,
               const int32_t * score_rows = nullptr, int32_t n_score_rows = 0) {
    const sekv_model_info & info = mem->model->info;
    if (!ready(mem)) return -1;
    if (n < 1) {
        sekv_set_error("no tokens to run");
        return -1;
    }
    if (mem->n_exact + n >= mem->params.exact_capacity) {
        sekv_set_error("the memory is full: exact_capacity reached");
        return -1;
    }
    if (position < 0) {
        sekv_set_error("negative position");
        return -1;
    }
    if (!vocab_ids(tokens, n, info.n_vocab, "token id out of range")) return -1;
    if (n_score_rows < 0 || (n_score_rows > 0 && score_rows == nullptr)) {
        sekv_set_error("score rows: a count >= 0 and, when it is not 0, the ids");
        return -1;
    }
    if (!vocab_ids(score_rows, n_score_rows, info.n_vocab, "score row id out of range")) return -1;
    const int32_t window = info.sliding_window;
    if (mem->ring > 0 && n > window + 1) {
        sekv_set_error("a chunk may hold at most sliding_window + 1 tokens (" + std::to_string(window + 1) + ")");
        return -1;
    }
    const size_t nodes = sekv_graph_nodes(mem, n, n_score_rows);
    if (mem->sched != nullptr && nodes > SEKV_SCHED_GRAPH_SIZE) {
        sekv_set_error("a chunk this long needs a larger graph than the scheduler holds: use shorter chunks");
        return -1;
    }
    const size_t meta = ggml_tensor_overhead() * nodes + ggml_graph_overhead_custom(nodes, false);
    mem->graph_meta.resize(meta);
    ggml_init_params ip = {meta, mem->graph_meta.data(), true};
    ggml_context * ctx = ggml_init(ip);
    sekv_graph_inputs in;
    sekv_zoom_outputs zoom;
    ggml_cgraph * gf = sekv_build_graph(mem, ctx, n, nll != nullptr, n_score_rows, in, zoom);
    if (mem->sched != nullptr) {
        ggml_backend_sched_reset(mem->sched);
    }
    if (!(mem->sched != nullptr ? ggml_backend_sched_alloc_graph(mem->sched, gf) : ggml_gallocr_alloc_graph(mem->allocr, gf))) {
        ggml_free(ctx);
        sekv_set_error("could not allocate the graph's compute buffer");
        return -1;
    }
    std::vector<int32_t> pos((size_t) n);
    for (int32_t i = 0; i < n; ++i) pos[i] = position + i;
    ggml_backend_tensor_set(in.tokens, tokens, 0, (size_t) n * sizeof(int32_t));
    ggml_backend_tensor_set(in.pos, pos.data(), 0, pos.size() * sizeof(int32_t));
    if (in.causal != nullptr) {  // rows held before the chunk: seen by every token; the chunk's own: causally
        const int64_t rows = mem->n_exact + n;
        std::vector<float> mask((size_t) (rows * n), 0.0f);
        for (int32_t t = 0; t < n; ++t) {
            for (int32_t j = t + 1; j < n; ++j) mask[(size_t) (t * rows + mem->n_exact + j)] = -INFINITY;
        }
        ggml_backend_tensor_set(in.causal, mask.data(), 0, mask.size() * sizeof(float));
    }
    std::vector<int32_t> ring_after = mem->ring_pos;
    if (mem->ring > 0) {  // the tokens' ring rows, then which rows each token sees: its window, itself included
        const int64_t C = mem->ring;
        std::vector<int32_t> slots((size_t) n);
        for (int32_t i = 0; i < n; ++i) {
            slots[i] = (int32_t) ((position + i) % C);
            ring_after[(size_t) slots[i]] = position + i;
        }
        std::vector<float> mask((size_t) (C * n));
        for (int32_t t = 0; t < n; ++t) {
            const int32_t p = position + t;
            for (int64_t j = 0; j < C; ++j) {
                const int32_t at = ring_after[(size_t) j];
                mask[(size_t) (t * C + j)] = at >= 0 && at <= p && p - at < window ? 0.0f : -INFINITY;
            }
        }
        ggml_backend_tensor_set(in.ring_slots, slots.data(), 0, slots.size() * sizeof(int32_t));
        ggml_backend_tensor_set(in.window_mask, mask.data(), 0, mask.size() * sizeof(float));
    }
    if (in.nll_index != nullptr) {
        ggml_backend_tensor_set(in.nll_index, tokens + 1, 0, (size_t) (n - 1) * sizeof(int32_t));
    }
    if (in.score_rows != nullptr) {
        ggml_backend_tensor_set(in.score_rows, score_rows, 0, (size_t) n_score_rows * sizeof(int32_t));
    }
    const ggml_status status = mem->sched != nullptr ? ggml_backend_sched_graph_compute(mem->sched, gf)
                                                     : ggml_backend_graph_compute(mem->model->cpu, gf);
    if (status != GGML_STATUS_SUCCESS) {
        ggml_free(ctx);
        sekv_set_error("the graph failed to compute");
        return -1;
    }
    ggml_backend_tensor_get(ggml_graph_get_tensor(gf, "logits"), logits, 0, (size_t) info.n_vocab * sizeof(float));
    if (nll != nullptr && n > 1) {
        ggml_backend_tensor_get(ggml_graph_get_tensor(gf, "nll"), nll, 0, (size_t) (n - 1) * sizeof(float));
    }
    read_zoom(mem, zoom);
    ggml_free(ctx);
    mem->n_exact += n;
    for (int32_t & rows : mem->layer_exact) rows = mem->n_exact;
    mem->ring_pos = std::move(ring_after);
    for (auto & t : mem->layers) {
        if (t.local) t.window_end = position + n;
    }
    return 0;
}

int sekv_decode(sekv_memory * mem, int32_t token, int32_t position, float * logits) {
    return run(mem, &token, 1, position, nullptr, logits);
}

int sekv_prefill(sekv_memory * mem, const int32_t * tokens, int32_t n, int32_t position, float * nll, float * logits,
                 const int32_t * score_rows, int32_t n_score_rows) {
    return run(mem, tokens, n, position, nll, logits, score_rows, n_score_rows);
}
