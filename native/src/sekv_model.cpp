// Loading a GGUF model through llama.cpp's own loader (quantized weights stay as llama.cpp keeps them).
#include "sekv_internal.h"

#include "ggml-cpu.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <mutex>

static thread_local std::string g_error;

void sekv_set_error(const std::string & message) { g_error = message; }

const char * sekv_last_error(void) { return g_error.c_str(); }

int sekv_dequantize(int32_t type, const void * src, float * dst, int64_t n) {
    if (type < 0 || type >= GGML_TYPE_COUNT || src == nullptr || dst == nullptr || n < 0) {
        sekv_set_error("dequantize: bad arguments");
        return -1;
    }
    const ggml_type_traits * traits = ggml_get_type_traits((ggml_type) type);
    if (traits->to_float == nullptr || traits->blck_size <= 0 || n % traits->blck_size != 0) {
        sekv_set_error(std::string("dequantize: no conversion to float for whole blocks of ") + traits->type_name);
        return -1;
    }
    traits->to_float(src, dst, n);
    return 0;
}

static void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static const char * unsupported(const llama_model * m) {
    const auto & hp = m->hparams;
    if (m->arch != LLM_ARCH_LLAMA && m->arch != LLM_ARCH_GEMMA3) {
        return "only llama- and gemma3-architecture models are supported by the native engine so far";
    }
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (hp.n_embd_head_k() != hp.n_embd_head_v() || hp.n_rot(il) != hp.n_embd_head_k()) {
            return "models whose RoPE does not cover the whole head are not supported";
        }
    }
    if (hp.rope_scaling_type_train == LLAMA_ROPE_SCALING_TYPE_YARN ||
        hp.rope_scaling_type_train == LLAMA_ROPE_SCALING_TYPE_LONGROPE) {
        return "YaRN / LongRoPE scaled models are not supported";
    }
    if (m->arch == LLM_ARCH_LLAMA && (hp.n_expert > 0 || hp.use_kq_norm)) {
        return "mixture-of-experts and QK-norm llama variants are not supported";
    }
    if (hp.swa_type != LLAMA_SWA_TYPE_NONE && hp.swa_type != LLAMA_SWA_TYPE_STANDARD) {
        return "only standard sliding windows are supported";
    }
    return nullptr;
}

// What the graph builder needs beyond llama's block: Gemma 3's scales and norms, and its sliding-window layers.
static void read_layer_shape(sekv_model * m, const llama_model * lm) {
    const auto & hp = lm->hparams;
    const bool gemma = lm->arch == LLM_ARCH_GEMMA3;
    m->embed_scale = gemma ? std::sqrt((float) hp.n_embd) : 1.0f;
    m->q_scale = hp.f_attention_scale != 0.0f ? hp.f_attention_scale : 1.0f / std::sqrt((float) hp.n_embd_head_k());
    m->logit_softcap = gemma ? hp.f_final_logit_softcapping : 0.0f;
    m->gelu = gemma;
    m->local.assign(hp.n_layer(), 0);
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        m->local[il] = hp.swa_type == LLAMA_SWA_TYPE_STANDARD && hp.is_swa(il) ? 1 : 0;
    }
    const bool any_local = std::find(m->local.begin(), m->local.end(), 1) != m->local.end();
    m->info.sliding_window = any_local ? (int32_t) hp.n_swa : 0;
    m->rope_base_swa = hp.rope_freq_base_train_swa;
    m->rope_scale_swa = hp.rope_freq_scale_train_swa;
}

sekv_model * sekv_model_load(const char * path, int32_t n_threads) { return sekv_model_load_on(path, n_threads, 0); }

sekv_model * sekv_model_load_on(const char * path, int32_t n_threads, int32_t gpu) {
    static std::once_flag init;
    std::call_once(init, [] {
        llama_log_set(quiet_log, nullptr);
        llama_backend_init();
    });
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    ggml_backend_dev_t gpu_dev = nullptr;
    ggml_backend_dev_t devices[2] = {nullptr, nullptr};
    if (gpu) {
        gpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
        if (gpu_dev == nullptr) {
            sekv_set_error("no GPU: this library was built without a GPU backend (sekv-local native build --cuda) "
                           "or no GPU is visible");
            return nullptr;
        }
        devices[0] = gpu_dev;
        mp.devices = devices;
        mp.n_gpu_layers = 9999;  // every layer and the output
    }
    llama_model * lm = llama_model_load_from_file(path, mp);
    if (lm == nullptr) {
        sekv_set_error(std::string("llama.cpp could not load ") + path);
        return nullptr;
    }
    if (const char * why = unsupported(lm)) {
        sekv_set_error(why);
        llama_model_free(lm);
        return nullptr;
    }
    auto * m = new sekv_model();
    m->model = lm;
    m->cpu = ggml_backend_cpu_init();
    m->n_threads = n_threads > 0 ? n_threads : 1;
    ggml_backend_cpu_set_n_threads(m->cpu, m->n_threads);
    if (gpu_dev != nullptr) {
        m->gpu_dev = gpu_dev;
        m->gpu = ggml_backend_dev_init(gpu_dev, nullptr);
        if (m->gpu == nullptr) {
            sekv_set_error("could not start the GPU backend");
            sekv_model_free(m);
            return nullptr;
        }
    }
    const auto & hp = lm->hparams;
    m->info.n_layer = (int32_t) hp.n_layer();
    m->info.n_head = (int32_t) hp.n_head();
    m->info.n_head_kv = (int32_t) hp.n_head_kv();
    m->info.head_dim = (int32_t) hp.n_embd_head_k();
    m->info.n_embd = (int32_t) hp.n_embd;
    m->info.n_vocab = (int32_t) llama_vocab_n_tokens(llama_model_get_vocab(lm));
    m->info.n_ctx_train = (int32_t) hp.n_ctx_train;
    m->rope_type = (int) llama_model_rope_type(lm);
    m->rope_base = hp.rope_freq_base_train;
    m->rope_scale = hp.rope_freq_scale_train;
    m->n_ctx_orig = (int) hp.n_ctx_orig_yarn;
    m->beta_fast = hp.yarn_beta_fast;
    m->beta_slow = hp.yarn_beta_slow;
    m->norm_eps = hp.f_norm_rms_eps;
    read_layer_shape(m, lm);
    if (!sekv_router_from_gguf(m, path)) {
        sekv_model_free(m);
        return nullptr;
    }
    return m;
}

void sekv_model_free(sekv_model * model) {
    if (model == nullptr) {
        return;
    }
    sekv_router_free(model);
    if (model->gpu) ggml_backend_free(model->gpu);
    if (model->cpu) ggml_backend_free(model->cpu);
    llama_model_free(model->model);
    delete model;
}

void sekv_model_get_info(const sekv_model * model, sekv_model_info * out) { *out = model->info; }

int32_t sekv_model_on_gpu(const sekv_model * model) { return model->gpu != nullptr ? 1 : 0; }

int32_t sekv_model_layer_is_local(const sekv_model * model, int32_t layer) {
    if (layer < 0 || layer >= model->info.n_layer) return -1;
    return model->local[layer];
}
