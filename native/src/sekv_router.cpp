// SeKV's learned router on the native side: read from a GGUF's sekv.* metadata at load, or set from Python.
//
// The decode graph needs two of its parameters: q_proj (pre-RoPE query -> routing space, per layer) and the
// per-head zoom thresholds. k_proj and the rank gate act when spans are compressed, which the torch engine
// does; the routing keys it produced come in with the memory (sekv_memory_set_layer_routing).
// Everything read from the file is checked against the model's dims: a bad router fails the load with a
// reason instead of routing with garbage.
#include "sekv_internal.h"

#include "gguf.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr uint32_t ROUTER_FORMAT_VERSION = 1;  // sekv_local/sekv/router_file.py FORMAT_VERSION

void free_router(sekv_model * m) {
    if (m->router_buf) ggml_backend_buffer_free(m->router_buf);
    if (m->router_ctx) ggml_free(m->router_ctx);
    m->router_buf = nullptr;
    m->router_ctx = nullptr;
    m->router_q = m->router_thr = nullptr;
    m->router_dim = 0;
}

// per layer, src [rows][cols] -> dst [cols][rows]
void transpose_layers(const float * src, float * dst, int64_t L, int64_t rows, int64_t cols) {
    for (int64_t il = 0; il < L; ++il) {
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t c = 0; c < cols; ++c) {
                dst[(il * cols + c) * rows + r] = src[(il * rows + r) * cols + c];
            }
        }
    }
}

bool all_finite(const float * x, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(x[i])) return false;
    }
    return true;
}

// an unsigned integer entry (the Python writer uses u32; accept any integer type a tool might rewrite it as)
bool read_uint(const gguf_context * g, const std::string & key, int64_t & out) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return false;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8: out = gguf_get_val_u8(g, id); return true;
        case GGUF_TYPE_UINT16: out = gguf_get_val_u16(g, id); return true;
        case GGUF_TYPE_UINT32: out = gguf_get_val_u32(g, id); return true;
        case GGUF_TYPE_INT32: out = gguf_get_val_i32(g, id); return true;
        case GGUF_TYPE_UINT64: out = (int64_t) gguf_get_val_u64(g, id); return true;
        case GGUF_TYPE_INT64: out = gguf_get_val_i64(g, id); return true;
        default: return false;
    }
}

// one layer's f32 array `sekv.blk.<il>.<name>` of exactly n values
const float * read_array(const gguf_context * g, int il, const char * name, size_t n, std::string & why) {
    const std::string key = "sekv.blk." + std::to_string(il) + "." + name;
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, id) != GGUF_TYPE_FLOAT32) {
        why = "'" + key + "' is missing or not an f32 array";
        return nullptr;
    }
    if (gguf_get_arr_n(g, id) != n) {
        why = "'" + key + "' must hold " + std::to_string(n) + " numbers, got " + std::to_string(gguf_get_arr_n(g, id));
        return nullptr;
    }
    return static_cast<const float *>(gguf_get_arr_data(g, id));
}

}  // namespace

bool sekv_router_from_gguf(sekv_model * m, const char * path) {
    gguf_init_params gp = {true, nullptr};
    gguf_context * g = gguf_init_from_file(path, gp);
    if (g == nullptr) {
        sekv_set_error(std::string("could not read the GGUF metadata of ") + path);
        return false;
    }
    int64_t version = 0;
    if (!read_uint(g, "sekv.format_version", version)) {
        gguf_free(g);
        return true;  // no router in this file: the training-free rule is all it can route with
    }
    const sekv_model_info & info = m->info;
    std::string why;
    int64_t dims[5] = {0, 0, 0, 0, 0};
    const char * names[5] = {"n_layers", "n_heads", "n_kv_heads", "head_dim", "routing_dim"};
    const int64_t want[4] = {info.n_layer, info.n_head, info.n_head_kv, info.head_dim};
    if (version != ROUTER_FORMAT_VERSION) {
        why = "SeKV router format version " + std::to_string(version) + " is not supported (this build reads " +
              std::to_string(ROUTER_FORMAT_VERSION) + ")";
    }
    for (int i = 0; i < 5 && why.empty(); ++i) {
        if (!read_uint(g, std::string("sekv.") + names[i], dims[i])) {
            why = std::string("'sekv.") + names[i] + "' is missing";
        } else if (i < 4 && dims[i] != want[i]) {
            why = std::string("the SeKV router was trained for another model: ") + names[i] + " " +
                  std::to_string(dims[i]) + " (model: " + std::to_string(want[i]) + ")";
        }
    }
    if (why.empty() && (dims[4] < 1 || dims[4] > info.head_dim)) {
        why = "sekv.routing_dim must be in [1, head_dim]";
    }
    std::vector<float> q_proj, thr;
    if (why.empty()) {
        const size_t D = info.head_dim, dp = (size_t) dims[4], H = info.n_head;
        q_proj.resize(info.n_layer * D * dp);
        thr.resize(info.n_layer * H);
        for (int il = 0; il < info.n_layer && why.empty(); ++il) {
            const float * q = read_array(g, il, "q_proj", D * dp, why);
            const float * t = q != nullptr ? read_array(g, il, "threshold_logit", H, why) : nullptr;
            if (t != nullptr) {
                std::memcpy(q_proj.data() + il * D * dp, q, D * dp * sizeof(float));
                std::memcpy(thr.data() + il * H, t, H * sizeof(float));
            }
        }
    }
    gguf_free(g);
    if (!why.empty()) {
        sekv_set_error(std::string(path) + ": " + why);
        return false;
    }
    return sekv_model_set_router(m, (int32_t) dims[4], q_proj.data(), thr.data()) == 0;
}

int sekv_model_set_router(sekv_model * m, int32_t routing_dim, const float * q_proj, const float * threshold) {
    const sekv_model_info & info = m->info;
    const int64_t L = info.n_layer, D = info.head_dim, H = info.n_head, dp = routing_dim;
    if (dp < 1 || dp > D) {
        sekv_set_error("sekv_model_set_router: routing_dim must be in [1, head_dim]");
        return -1;
    }
    if (!all_finite(q_proj, (size_t) (L * D * dp)) || !all_finite(threshold, (size_t) (L * H))) {
        sekv_set_error("sekv_model_set_router: non-finite router parameters");
        return -1;
    }
    free_router(m);
    ggml_init_params ip = {ggml_tensor_overhead() * 4, nullptr, true};
    m->router_ctx = ggml_init(ip);
    // per layer q_proj^T [D, d']: mul_mat(q_proj^T, q) = q . q_proj
    m->router_q = ggml_new_tensor_3d(m->router_ctx, GGML_TYPE_F32, D, dp, L);
    m->router_thr = ggml_new_tensor_2d(m->router_ctx, GGML_TYPE_F32, H, L);
    ggml_backend_t main = m->gpu != nullptr ? m->gpu : m->cpu;
    m->router_buf = ggml_backend_alloc_ctx_tensors_from_buft(m->router_ctx, ggml_backend_get_default_buffer_type(main));
    if (m->router_buf == nullptr) {
        free_router(m);
        sekv_set_error("could not allocate the router parameters");
        return -1;
    }
    // the router is part of the model (like its weights), not of any one document's memory
    ggml_backend_buffer_set_usage(m->router_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    std::vector<float> transposed((size_t) (L * D * dp));
    transpose_layers(q_proj, transposed.data(), L, D, dp);
    ggml_backend_tensor_set(m->router_q, transposed.data(), 0, transposed.size() * sizeof(float));
    ggml_backend_tensor_set(m->router_thr, threshold, 0, (size_t) (L * H) * sizeof(float));
    m->router_dim = routing_dim;
    return 0;
}

int32_t sekv_model_router_dim(const sekv_model * m) { return m->router_dim; }

int sekv_model_get_router(const sekv_model * m, float * q_proj, float * threshold) {
    if (m->router_dim == 0) {
        sekv_set_error("the model has no learned router");
        return -1;
    }
    const sekv_model_info & info = m->info;
    const int64_t L = info.n_layer, D = info.head_dim, H = info.n_head, dp = m->router_dim;
    std::vector<float> transposed((size_t) (L * D * dp));
    ggml_backend_tensor_get(m->router_q, transposed.data(), 0, transposed.size() * sizeof(float));
    transpose_layers(transposed.data(), q_proj, L, dp, D);
    ggml_backend_tensor_get(m->router_thr, threshold, 0, (size_t) (L * H) * sizeof(float));
    return 0;
}

void sekv_router_free(sekv_model * m) { free_router(m); }
