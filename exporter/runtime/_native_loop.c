/* Greedy decode steps of decode.onnx in C, over onnxruntime's C API (exporter/capi.py holds the session).

   A step in Python costs a few hundred microseconds of interpreter work around onnxruntime's run; here it costs
   the run, an argmax and a few pointer moves. The API is reached through the table exporter.runtime.capi hands over, by
   the indices of the C API's first block (ORT_API_VERSION 1), which onnxruntime never changes. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef void *OrtStatusPtr;
typedef OrtStatusPtr (*RunFn)(void *session, void *run_options, const char *const *input_names,
                              void *const *inputs, size_t input_count, const char *const *output_names,
                              size_t output_count, void **outputs);
typedef OrtStatusPtr (*CreateTensorFn)(void *memory_info, void *data, size_t bytes, const int64_t *shape,
                                       size_t rank, int element_type, void **value);
typedef const char *(*ErrorMessageFn)(OrtStatusPtr status);
typedef void (*ReleaseFn)(void *object);

enum { GET_ERROR_MESSAGE = 2, RUN = 9, CREATE_TENSOR_WITH_DATA = 49, RELEASE_STATUS = 93, RELEASE_VALUE = 96 };
enum { FLOAT32 = 1, INT64 = 7 };
enum { MAX_CACHE = 1024 }; /* past inputs: 2 per layer */

typedef struct {
    void **api;
    void *session, *memory;
    const char *const *input_names, *const *output_names;
    size_t cache_count;
    void **cache;           /* cache_count OrtValues: the pasts in, the presents out */
    int64_t *mask;          /* the generation's mask, at least past_length + steps long */
    int64_t past_length, position, token;
    int64_t steps, vocab;
    const int64_t *stops;
    int64_t stop_count;
    int64_t *tokens;        /* out: the tokens chosen */
    float *logits;          /* vocab floats: the last step's logits, written by onnxruntime */
    int64_t steps_run;      /* out: the steps that ran, the one whose logits held a NaN included */
    int non_finite;         /* out: a step's logits held a NaN, so no token was chosen after it */
    char error[512];
} Loop;

static void fail(Loop *loop, OrtStatusPtr status) {
    snprintf(loop->error, sizeof loop->error, "%s", ((ErrorMessageFn)loop->api[GET_ERROR_MESSAGE])(status));
    ((ReleaseFn)loop->api[RELEASE_STATUS])(status);
}

/* Returns the tokens chosen (a stop id ends the loop after it); a failure sets loop->error, and the cache then
   holds the values of the last step that ran. */
static int64_t run_loop(Loop *loop) {
    RunFn run = (RunFn)loop->api[RUN];
    CreateTensorFn tensor = (CreateTensorFn)loop->api[CREATE_TENSOR_WITH_DATA];
    ReleaseFn release = (ReleaseFn)loop->api[RELEASE_VALUE];
    int64_t ids = 0, position = 0, one_by_one[2] = {1, 1}, logits_shape[3] = {1, 1, loop->vocab};
    void *inputs[3 + MAX_CACHE], *outputs[1 + MAX_CACHE];
    void *ids_value = NULL, *position_value = NULL, *logits_value = NULL;
    int64_t done = 0;
    OrtStatusPtr status;
    if ((status = tensor(loop->memory, &ids, sizeof ids, one_by_one, 2, INT64, &ids_value)) ||
        (status = tensor(loop->memory, &position, sizeof position, one_by_one, 2, INT64, &position_value)) ||
        (status = tensor(loop->memory, loop->logits, sizeof(float) * loop->vocab, logits_shape, 3, FLOAT32,
                         &logits_value))) {
        fail(loop, status);
        goto out;
    }
    for (; done < loop->steps; done++) {
        int64_t mask_shape[2] = {1, loop->past_length + 1};
        void *mask_value = NULL;
        ids = loop->token;
        position = loop->position;
        if ((status = tensor(loop->memory, loop->mask, sizeof(int64_t) * mask_shape[1], mask_shape, 2, INT64,
                             &mask_value))) {
            fail(loop, status);
            goto out;
        }
        inputs[0] = ids_value;
        inputs[1] = mask_value;
        inputs[2] = position_value;
        memcpy(inputs + 3, loop->cache, loop->cache_count * sizeof(void *));
        outputs[0] = logits_value; /* written in place; the presents are allocated by onnxruntime */
        memset(outputs + 1, 0, loop->cache_count * sizeof(void *));
        status = run(loop->session, NULL, loop->input_names, inputs, 3 + loop->cache_count, loop->output_names,
                     1 + loop->cache_count, outputs);
        release(mask_value);
        if (status) {
            fail(loop, status);
            goto out;
        }
        for (size_t i = 0; i < loop->cache_count; i++)
            release(loop->cache[i]);
        memcpy(loop->cache, outputs + 1, loop->cache_count * sizeof(void *));
        loop->steps_run++;
        loop->past_length++;
        loop->position++;
        int64_t best = 0; /* the first of equal maxima, as numpy's argmax; a NaN chooses nothing */
        for (int64_t v = 0; v < loop->vocab; v++) {
            if (isnan(loop->logits[v])) {
                loop->non_finite = 1;
                goto out;
            }
            if (loop->logits[v] > loop->logits[best])
                best = v;
        }
        loop->token = loop->tokens[done] = best;
        for (int64_t s = 0; s < loop->stop_count; s++)
            if (loop->stops[s] == best) {
                done++;
                goto out;
            }
    }
out:
    if (ids_value) release(ids_value);
    if (position_value) release(position_value);
    if (logits_value) release(logits_value);
    return done;
}

static PyObject *greedy(PyObject *self, PyObject *args) {
    Loop loop = {.error = ""};
    unsigned long long api, session, memory, input_names, output_names, cache, mask, stops, tokens, logits;
    Py_ssize_t cache_count;
    if (!PyArg_ParseTuple(args, "KKKKKnKKLLLLKLKKL", &api, &session, &memory, &input_names, &output_names,
                          &cache_count, &cache, &mask, &loop.past_length, &loop.position, &loop.token, &loop.steps,
                          &stops, &loop.stop_count, &tokens, &logits, &loop.vocab))
        return NULL;
    if (cache_count < 0 || cache_count > MAX_CACHE || loop.steps < 0 || loop.stop_count < 0 || loop.vocab < 1) {
        PyErr_SetString(PyExc_ValueError, "greedy: a count out of range");
        return NULL;
    }
    loop.api = (void **)(uintptr_t)api;
    loop.session = (void *)(uintptr_t)session;
    loop.memory = (void *)(uintptr_t)memory;
    loop.input_names = (const char *const *)(uintptr_t)input_names;
    loop.output_names = (const char *const *)(uintptr_t)output_names;
    loop.cache_count = (size_t)cache_count;
    loop.cache = (void **)(uintptr_t)cache;
    loop.mask = (int64_t *)(uintptr_t)mask;
    loop.stops = (const int64_t *)(uintptr_t)stops;
    loop.tokens = (int64_t *)(uintptr_t)tokens;
    loop.logits = (float *)(uintptr_t)logits;
    int64_t done;
    Py_BEGIN_ALLOW_THREADS
    done = run_loop(&loop);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(LLis)", done, loop.steps_run, loop.non_finite, loop.error);
}

static PyMethodDef methods[] = {
    {"greedy", greedy, METH_VARARGS,
     "greedy(api, session, memory, input_names, output_names, cache_count, cache, mask, past_length, position, "
     "token, steps, stops, stop_count, tokens, logits, vocab) -> (tokens chosen, steps run, a NaN met, error or ''): "
     "pointers as ints"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "exporter.runtime._native_loop", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native_loop(void) { return PyModule_Create(&module); }
