# kdtree: build, test, run, bench, deps, install, clean.
# `make` builds libkdtree.so (C core + CPU backend, + the CUDA backend when nvcc is found).
PREFIX  ?= /usr/local
DESTDIR ?=
CC      ?= cc
NVCC    ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA    ?= $(if $(NVCC),1,0)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))

CFLAGS  ?= -O2 -g
# SAN: sanitizer flags for compiling and linking the library (test-asan sets them)
SAN     ?=
CFLAGS  += -std=c11 -D_GNU_SOURCE -fPIC -Wall -Wextra -Wno-unused-parameter -Icore $(SAN)
LDLIBS  := -lcjson -lpcre2-8 -lm -lpthread
CORE_SRC := $(wildcard core/*.c core/cpu/*.c)
CUDA_SRC := $(wildcard cuda/*.cu)
BUILD   := build
CORE_OBJ := $(CORE_SRC:%.c=$(BUILD)/%.o)
CUDA_OBJ := $(CUDA_SRC:%.cu=$(BUILD)/%.o)
# sm_90 (H200) and sm_120 (RTX PRO 6000 Blackwell) machine code, plus sm_120 PTX for newer parts
NVFLAGS ?= -O3 -std=c++17 -Xcompiler -fPIC -Icore -lineinfo \
           -gencode arch=compute_90,code=sm_90 -gencode arch=compute_120,code=sm_120 \
           -gencode arch=compute_120,code=compute_120

ifeq ($(CUDA),1)
  CFLAGS += -DKD_WITH_CUDA
  OBJ := $(CORE_OBJ) $(CUDA_OBJ)
  LDLIBS += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lcublas -lcublasLt -lstdc++
else
  OBJ := $(CORE_OBJ)
endif

LUAJIT  := luajit
# Debian's busted script starts with `#!/usr/bin/env lua`: run it under LuaJIT
BUSTED  := $(LUAJIT) $(shell command -v busted 2>/dev/null || echo /usr/bin/busted)
DEB_PKGS := luajit libluajit-5.1-dev lua-busted lua-dkjson libcjson-dev libpcre2-dev libreadline8
FUZZ_PKGS := clang python3

.PHONY: all test test-gpu test-asan fuzz fuzz-build deps-fuzz run bench bench-trace deps install clean
all: $(BUILD)/libkdtree.so

$(BUILD)/libkdtree.so: $(OBJ)
	$(CC) $(SAN) -shared -o $@ $^ $(LDLIBS)

$(BUILD)/%.o: %.c $(wildcard core/*.h core/cpu/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c -o $@ $<

$(BUILD)/%.o: %.cu $(wildcard core/*.h cuda/*.cuh)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c -o $@ $<

# deps: the Debian packages; as root install them, otherwise print the command.
# deps-fuzz: the same for what `make fuzz` needs besides (clang's libFuzzer, python3 for the seeds)
install_pkgs = @missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "missing packages:$$missing"; echo "run: sudo apt-get install -y$$missing"; exit 1; fi; fi
deps:
	$(call install_pkgs,$(DEB_PKGS))
deps-fuzz: deps
	$(call install_pkgs,$(FUZZ_PKGS))

test: deps all
	KDTREE_LIB=$(BUILD)/libkdtree.so $(BUSTED) --exclude-tags=gpu,slow spec

# test-asan: the CPU suite against the library built with ASan + UBSan (every report fatal) in
# $(BUILD)/asan; LuaJIT is not instrumented, so the ASan runtime is preloaded into it, and
# LeakSanitizer checks at each process's exit (busted's, and every CLI the specs run; the C
# toolchain a spec runs is suppressed: scripts/sanitize/lsan.supp).
ASAN_SAN := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
ASAN_ENV := LD_PRELOAD=$$($(CC) -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=1 \
            LSAN_OPTIONS=suppressions=$(CURDIR)/scripts/sanitize/lsan.supp:print_suppressions=0 \
            UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
test-asan: deps
	$(MAKE) CUDA=0 BUILD=$(BUILD)/asan SAN="$(ASAN_SAN)" all
	$(ASAN_ENV) KDTREE_LIB=$(BUILD)/asan/libkdtree.so $(BUSTED) --exclude-tags=gpu,slow spec

# fuzz: libFuzzer harnesses (fuzz/*.c; clang, ASan + UBSan) over the loaders, seeded from the
# fixtures (fuzz/seeds.py), each for FUZZ_SECONDS (fuzz/run.sh). Crashes land in $(BUILD)/fuzz/crashes/.
FUZZ_TARGETS := safetensors config drafter tokenizer encode
FUZZ_SECONDS ?= 45
FUZZ_CC      ?= clang
FUZZ_SAN     := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
FUZZ_OBJ     := $(CORE_SRC:%.c=$(BUILD)/fuzz/%.o)
FUZZ_BIN     := $(FUZZ_TARGETS:%=$(BUILD)/fuzz/fuzz_%)
$(BUILD)/fuzz/%.o: %.c $(wildcard core/*.h core/cpu/*.h)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) -O1 -g -std=c11 -D_GNU_SOURCE -Icore $(FUZZ_SAN) -fsanitize=fuzzer-no-link -c -o $@ $<
$(BUILD)/fuzz/fuzz_%: fuzz/%.c fuzz/common.h $(FUZZ_OBJ)
	$(FUZZ_CC) -O1 -g -std=c11 -D_GNU_SOURCE -Icore $(FUZZ_SAN) -fsanitize=fuzzer -o $@ $< $(FUZZ_OBJ) $(LDLIBS)
fuzz-build: deps-fuzz $(FUZZ_BIN)
	rm -rf $(BUILD)/fuzz/seeds && python3 fuzz/seeds.py $(BUILD)/fuzz/seeds
fuzz: fuzz-build
	fuzz/run.sh $(BUILD)/fuzz $(FUZZ_SECONDS) $(FUZZ_TARGETS)
.SECONDARY: $(FUZZ_OBJ)

test-gpu: all
	KDTREE_LIB=$(BUILD)/libkdtree.so KDTREE_BACKEND=cuda $(BUSTED) spec

run: deps all
	KDTREE_LIB=$(BUILD)/libkdtree.so $(LUAJIT) scripts/kdtree generate --model models/tiny-k2.6 \
	  --draft models/tiny-k2.6-dflash --policy ddtree --budget 16 --prompt-ids 5,77,300 -n 32 --stats

# bench (GPU machine, one run): the W4A16 program first (ceilings measured in the same run:
# D2D copy, a read-only kernel, cuBLAS bf16 8192^3; fp64 checks; GEMM and MoE timings; it
# needs only cuda/w4a16.cu, cuda/w4a16_skinny.cu, core/error.c and cuBLAS), then the backend's op timings
# (dense linear, MLA attention, tree top-k) when the whole library builds.
# Tables: $(BUILD)/bench/w4a16.md (copied into docs/performance.md by hand, with the date).
BENCH_W4 := $(BUILD)/bench/w4a16_bench
W4_OBJS := $(BUILD)/cuda/w4a16.o $(BUILD)/cuda/w4a16_skinny.o $(BUILD)/core/error.o
$(BENCH_W4): scripts/bench/w4a16_bench.cu cuda/w4a16.cuh $(W4_OBJS)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -Xcompiler -fopenmp -o $@ $< $(W4_OBJS) -lcublas -lgomp

# Then the decode step of a K2.6-dims model slice (1 dense + 3 MoE layers, random weights built
# in memory) against its weight-bytes roofline, and the MLA attention rows: $(BUILD)/bench/model_slice.md.
BENCH_SLICE := $(BUILD)/bench/model_slice_bench
$(BENCH_SLICE): scripts/bench/model_slice_bench.c scripts/bench/slice_cuda.cu scripts/bench/slice_cuda.h \
                $(BUILD)/libkdtree.so
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c -o $(BUILD)/bench/slice_cuda.o scripts/bench/slice_cuda.cu
	$(CC) -O2 -g -std=c11 -D_GNU_SOURCE -DKD_SLICE_EVENTS -Icore -Iscripts/bench scripts/bench/model_slice_bench.c \
	  $(BUILD)/bench/slice_cuda.o -L$(BUILD) -lkdtree -Wl,-rpath,$(abspath $(BUILD)) \
	  -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lstdc++ -ldl -lm -o $@

# The small-M INT4 kernel's launch timeline (%globaltimer per block at six points, 32 launches
# in a graph with PDL): w4a16_skinny.cu built again with KD_W4A16_TRACE, apart from the library.
BENCH_TRACE := $(BUILD)/bench/w4a16_trace
TRACE_SKINNY := $(BUILD)/bench/trace/w4a16_skinny.o
TRACE_OBJS := $(filter-out $(BUILD)/cuda/w4a16_skinny.o,$(W4_OBJS)) $(TRACE_SKINNY)
$(TRACE_SKINNY): cuda/w4a16_skinny.cu $(wildcard core/*.h cuda/*.cuh)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -DKD_W4A16_TRACE -c -o $@ $<
$(BENCH_TRACE): scripts/bench/w4a16_bench.cu $(TRACE_OBJS)
	$(NVCC) $(NVFLAGS) -DKD_W4A16_TRACE -Xcompiler -fopenmp -o $@ $< $(TRACE_OBJS) -lcublas -lgomp
bench-trace: $(BENCH_TRACE)
	$(BENCH_TRACE) --trace

bench: $(BENCH_W4)
	$(BENCH_W4) --md $(BUILD)/bench/w4a16.md
	-$(MAKE) all && $(CC) -O2 -std=c11 -D_GNU_SOURCE -Icore scripts/bench/cuda_ops_bench.c -L$(BUILD) -lkdtree \
	  -Wl,-rpath,$(CURDIR)/$(BUILD) -o $(BUILD)/bench/cuda_ops_bench && $(BUILD)/bench/cuda_ops_bench
	-$(MAKE) $(BENCH_SLICE) && $(BENCH_SLICE) --md $(BUILD)/bench/model_slice.md
	-mkdir -p $(BUILD)/bench && KDTREE_LIB=$(BUILD)/libkdtree.so $(LUAJIT) scripts/bench/memory_report.lua --md $(BUILD)/bench/memory.md

install: all
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/bin \
	  $(DESTDIR)$(PREFIX)/share/lua/5.1/kdtree/policy $(DESTDIR)$(PREFIX)/share/lua/5.1/kdtree/drafters \
	  $(DESTDIR)$(PREFIX)/share/kdtree/models
	install -m 644 $(BUILD)/libkdtree.so $(DESTDIR)$(PREFIX)/lib/
	install -m 644 core/kdtree.h $(DESTDIR)$(PREFIX)/include/
	install -m 644 lua/kdtree/*.lua $(DESTDIR)$(PREFIX)/share/lua/5.1/kdtree/
	install -m 644 lua/kdtree/policy/*.lua $(DESTDIR)$(PREFIX)/share/lua/5.1/kdtree/policy/
	install -m 644 lua/kdtree/drafters/*.lua $(DESTDIR)$(PREFIX)/share/lua/5.1/kdtree/drafters/
	install -m 755 scripts/kdtree $(DESTDIR)$(PREFIX)/bin/kdtree
	cp -r models/tiny-k2.6 models/tiny-k2.6-dflash $(DESTDIR)$(PREFIX)/share/kdtree/models/

clean:
	rm -rf $(BUILD)
