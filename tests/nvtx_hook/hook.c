/*
 * A tiny NVTX v3 tool: records range push/pop events to a text file, one line per event.
 *
 * The tests build it into a shared library and point NVTX_INJECTION64_PATH at it. Any NVTX
 * client in the process (the `nvtx` Python package, libraries built on the NVTX headers) then
 * calls into it the way it calls into Nsight Systems, so the tests see what gdtool really emits.
 *
 * Output file: path in env NVTX_HOOK_LOG, one tab-separated line per event, in call order. When
 * NVTX_HOOK_LOG is unset each callback returns at once: a no-op tool, for timing what an NVTX
 * client costs by itself.
 *
 *     push <tid> <domain> <message> <payload>
 *     pop  <tid> <domain>
 *
 * <domain> is "-" for the default domain (nvtxRangePushA/Ex/Pop). <message> is the ASCII or
 * registered string ("?" for a wide string, "" for none). <payload> is "i64:<n>" for an int64
 * payload, "u64:", "f64:", "i32:", "u32:", "f32:" for the others, "ext:<type>" for extended
 * (schema) payloads and "-" for none.
 *
 * The declarations below are the few that a tool needs from the NVTX v3 headers (NVIDIA/NVTX,
 * Apache-2.0 WITH LLVM-exception, nvToolsExt.h and nvtxDetail/nvtxTypes.h): the layout of
 * nvtxEventAttributes_t, the callback module and id numbers, and the export table through which
 * a tool fills the client's function slots. They are part of NVTX's stable ABI.
 *
 * Not handled on purpose: the payload extension (nvtxRangePushPayload, schemas). Without an
 * InitializeInjectionNvtxExtension entry point NVTX reports every domain as enabled, which is
 * what the `nvtx` package needs to hand out a real Domain instead of its DummyDomain.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <wchar.h>

/* ---- from nvToolsExt.h ---- */
enum { NVTX_MESSAGE_UNKNOWN = 0, NVTX_MESSAGE_TYPE_ASCII = 1, NVTX_MESSAGE_TYPE_UNICODE = 2,
       NVTX_MESSAGE_TYPE_REGISTERED = 3 };
enum { NVTX_PAYLOAD_UNKNOWN = 0, NVTX_PAYLOAD_TYPE_UNSIGNED_INT64 = 1, NVTX_PAYLOAD_TYPE_INT64 = 2,
       NVTX_PAYLOAD_TYPE_DOUBLE = 3, NVTX_PAYLOAD_TYPE_UNSIGNED_INT32 = 4, NVTX_PAYLOAD_TYPE_INT32 = 5,
       NVTX_PAYLOAD_TYPE_FLOAT = 6 };

typedef struct hook_domain { char name[128]; } hook_domain;   /* what nvtxDomainHandle_t points to */
typedef struct hook_string { char text[256]; } hook_string;   /* what nvtxStringHandle_t points to */

typedef struct nvtxEventAttributes_v2 {
    uint16_t version;
    uint16_t size;
    uint32_t category;
    int32_t colorType;
    uint32_t color;
    int32_t payloadType;
    int32_t reserved0;
    union { uint64_t ullValue; int64_t llValue; double dValue;
            uint32_t uiValue; int32_t iValue; float fValue; } payload;
    int32_t messageType;
    union { const char* ascii; const wchar_t* unicode; hook_string* registered; } message;
} nvtxEventAttributes_t;

/* ---- from nvtxDetail/nvtxTypes.h ---- */
enum { NVTX_CB_MODULE_CORE = 1, NVTX_CB_MODULE_CORE2 = 5 };
enum { NVTX_CBID_CORE_RangePushEx = 8, NVTX_CBID_CORE_RangePushA = 9, NVTX_CBID_CORE_RangePop = 11 };
enum { NVTX_CBID_CORE2_DomainRangePushEx = 4, NVTX_CBID_CORE2_DomainRangePop = 5,
       NVTX_CBID_CORE2_DomainRegisterStringA = 10, NVTX_CBID_CORE2_DomainCreateA = 12,
       NVTX_CBID_CORE2_DomainDestroy = 14 };
enum { NVTX_ETID_CALLBACKS = 1 };

typedef void (*NvtxFunctionPointer)(void);
typedef NvtxFunctionPointer** NvtxFunctionTable;
typedef struct NvtxExportTableCallbacks {
    size_t struct_size;
    int (*GetModuleFunctionTable)(int callback_module, NvtxFunctionTable* out_table,
                                  unsigned int* out_size);
} NvtxExportTableCallbacks;
typedef const void* (*NvtxGetExportTableFunc_t)(uint32_t exportTableId);

/* ---- the tool ---- */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static FILE* out = NULL;

static void close_log(void) {
    pthread_mutex_lock(&lock);
    if (out) { fclose(out); out = NULL; }
    pthread_mutex_unlock(&lock);
}

static long thread_id(void) { return (long)syscall(SYS_gettid); }

static void write_push(const char* domain, const nvtxEventAttributes_t* a) {
    char payload[64] = "-";
    const char* message = "";
    if (out == NULL) return;  /* no log file: a no-op tool, to time the client side alone */
    if (a) {
        switch (a->payloadType) {
        case NVTX_PAYLOAD_UNKNOWN: break;
        case NVTX_PAYLOAD_TYPE_INT64: snprintf(payload, sizeof payload, "i64:%lld", (long long)a->payload.llValue); break;
        case NVTX_PAYLOAD_TYPE_UNSIGNED_INT64: snprintf(payload, sizeof payload, "u64:%llu", (unsigned long long)a->payload.ullValue); break;
        case NVTX_PAYLOAD_TYPE_DOUBLE: snprintf(payload, sizeof payload, "f64:%.17g", a->payload.dValue); break;
        case NVTX_PAYLOAD_TYPE_INT32: snprintf(payload, sizeof payload, "i32:%d", a->payload.iValue); break;
        case NVTX_PAYLOAD_TYPE_UNSIGNED_INT32: snprintf(payload, sizeof payload, "u32:%u", a->payload.uiValue); break;
        case NVTX_PAYLOAD_TYPE_FLOAT: snprintf(payload, sizeof payload, "f32:%.9g", (double)a->payload.fValue); break;
        default: snprintf(payload, sizeof payload, "ext:%d", a->payloadType); break;
        }
        switch (a->messageType) {
        case NVTX_MESSAGE_TYPE_ASCII: message = a->message.ascii ? a->message.ascii : ""; break;
        case NVTX_MESSAGE_TYPE_REGISTERED: message = a->message.registered ? a->message.registered->text : ""; break;
        case NVTX_MESSAGE_TYPE_UNICODE: message = "?"; break;
        default: break;
        }
    }
    pthread_mutex_lock(&lock);
    if (out) fprintf(out, "push\t%ld\t%s\t%s\t%s\n", thread_id(), domain, message, payload);
    pthread_mutex_unlock(&lock);
}

static void write_pop(const char* domain) {
    if (out == NULL) return;
    pthread_mutex_lock(&lock);
    if (out) fprintf(out, "pop\t%ld\t%s\n", thread_id(), domain);
    pthread_mutex_unlock(&lock);
}

static const char* domain_name(const hook_domain* d) { return d ? d->name : "-"; }

static int range_push_ex(const nvtxEventAttributes_t* a) { write_push("-", a); return 0; }
static int range_push_a(const char* message) {
    nvtxEventAttributes_t a;
    memset(&a, 0, sizeof a);
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = message;
    write_push("-", &a);
    return 0;
}
static int range_pop(void) { write_pop("-"); return 0; }
static int domain_range_push_ex(hook_domain* d, const nvtxEventAttributes_t* a) {
    write_push(domain_name(d), a);
    return 0;
}
static int domain_range_pop(hook_domain* d) { write_pop(domain_name(d)); return 0; }
static hook_domain* domain_create_a(const char* name) {
    hook_domain* d = calloc(1, sizeof *d);
    if (d) snprintf(d->name, sizeof d->name, "%s", name ? name : "");
    return d;
}
static void domain_destroy(hook_domain* d) { (void)d; /* handles may still be in use: keep them */ }
static hook_string* domain_register_string_a(hook_domain* d, const char* text) {
    hook_string* s = calloc(1, sizeof *s);
    (void)d;
    if (s) snprintf(s->text, sizeof s->text, "%s", text ? text : "");
    return s;
}

static int fill(NvtxFunctionTable table, unsigned int size, unsigned int id, NvtxFunctionPointer fn) {
    if (id > size || table[id] == NULL) return 0;
    *table[id] = fn;
    return 1;
}

int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_export_table) {
    const NvtxExportTableCallbacks* callbacks;
    NvtxFunctionTable core = NULL, core2 = NULL;
    unsigned int core_size = 0, core2_size = 0;
    const char* path = getenv("NVTX_HOOK_LOG");

    pthread_mutex_lock(&lock);
    /* Each NVTX client in the process (each copy of the headers) initialises the tool once. */
    if (out == NULL && path && *path) {
        out = fopen(path, "a");
        if (out) atexit(close_log);
    }
    pthread_mutex_unlock(&lock);

    callbacks = (const NvtxExportTableCallbacks*)get_export_table(NVTX_ETID_CALLBACKS);
    if (!callbacks || callbacks->struct_size < sizeof(NvtxExportTableCallbacks)) return 0;
    if (!callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &core, &core_size)) return 0;
    if (!callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &core2, &core2_size)) return 0;

    fill(core, core_size, NVTX_CBID_CORE_RangePushEx, (NvtxFunctionPointer)range_push_ex);
    fill(core, core_size, NVTX_CBID_CORE_RangePushA, (NvtxFunctionPointer)range_push_a);
    fill(core, core_size, NVTX_CBID_CORE_RangePop, (NvtxFunctionPointer)range_pop);
    fill(core2, core2_size, NVTX_CBID_CORE2_DomainRangePushEx, (NvtxFunctionPointer)domain_range_push_ex);
    fill(core2, core2_size, NVTX_CBID_CORE2_DomainRangePop, (NvtxFunctionPointer)domain_range_pop);
    fill(core2, core2_size, NVTX_CBID_CORE2_DomainRegisterStringA, (NvtxFunctionPointer)domain_register_string_a);
    fill(core2, core2_size, NVTX_CBID_CORE2_DomainCreateA, (NvtxFunctionPointer)domain_create_a);
    fill(core2, core2_size, NVTX_CBID_CORE2_DomainDestroy, (NvtxFunctionPointer)domain_destroy);
    return 1;  /* success: NVTX keeps the library loaded */
}
