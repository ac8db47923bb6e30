// LD_PRELOAD shim for benchmarks/gpu/check.sh. nvFuser's wheel, built against torch 2.10, references
// c10::MessageLogger(const char*, int, int, bool); torch 2.11 replaced it by MessageLogger(SourceLocation, int, bool)
// and a larger object. This symbol only lets the library load: if nvFuser ever logs through it, the process stops.
#include <cstdio>
#include <cstdlib>
extern "C" void _ZN3c1013MessageLoggerC1EPKciib(void*, const char* file, int line, int severity, bool) {
  std::fprintf(stderr, "nvfuser_abi_shim: nvFuser logged through c10::MessageLogger at %s:%d (severity %d); "
               "that constructor's ABI changed in torch 2.11\n", file, line, severity);
  std::abort();
}
