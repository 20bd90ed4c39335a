# kdtree: build, test, run, bench, deps, install, clean.
# `make` builds libkdtree.so: the C core and the CPU backend, plus the CUDA backend when nvcc is
# found (CUDA=0 leaves it out, CUDA=1 insists on it); it exports exactly the functions of
# core/kdtree.h. The specs run against libkdtree_test.so: the same objects plus the test surface
# of spec/c/ (op harness, fault injection, graph emulation), which no installed file contains.
# CUDA_ARCHS lists the GPU architectures compiled (machine code for each, PTX for the last one):
# "90 120" = H100/H200 and RTX PRO 6000 Blackwell. A change of CUDA, CUDA_ARCHS, CC, CFLAGS or
# NVFLAGS rebuilds every object (build/config.stamp records the last one).
PREFIX  ?= /usr/local
DESTDIR ?=
CC      ?= cc
NVCC    ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA    ?= $(if $(NVCC),1,0)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
# NCCL (the communicator between GPUs, cuda/comm.cu): with the CUDA toolkit, else the system's
NCCL_HOME ?= $(if $(wildcard $(CUDA_HOME)/include/nccl.h),$(CUDA_HOME),/usr)
CUDA_ARCHS ?= 90 120
JOBS    ?= $(shell nproc 2>/dev/null || echo 2)
# the model `make run` decodes with, and its drafter: the trained mini-code pair (docs/mini-code.md)
RUN_MODEL ?= models/mini-code
RUN_DRAFT ?= models/mini-code-dflash
# the library's version: kd_version() in core/error.c is the one place it is written
VERSION := $(shell sed -n 's/.*kd_version(void) { return "\([0-9.]*\)".*/\1/p' core/error.c)
SOVERSION := $(firstword $(subst ., ,$(VERSION)))

CFLAGS  ?= -O2 -g
# SAN: sanitizer flags for compiling and linking the library (test-asan sets them)
SAN     ?=
CFLAGS  += -std=c11 -D_GNU_SOURCE -fPIC -Wall -Wextra -Wno-unused-parameter -Icore $(SAN)
# the library's own objects: nothing exported but what the version script names
HIDDEN  := -fvisibility=hidden
LDLIBS  := -lcjson -lpcre2-8 -lm -lpthread
CORE_SRC := $(wildcard core/*.c core/cpu/*.c)
CUDA_SRC := $(wildcard cuda/*.cu)
BUILD   := build
CORE_OBJ := $(CORE_SRC:%.c=$(BUILD)/%.o)
CUDA_OBJ := $(CUDA_SRC:%.cu=$(BUILD)/%.o)
TEST_SRC := $(wildcard spec/c/*.c)
TEST_OBJ := $(TEST_SRC:%.c=$(BUILD)/%.o)
# machine code for every architecture of CUDA_ARCHS, plus PTX of the last one for newer parts
NVFLAGS ?= -O3 -std=c++17 -Xcompiler -fPIC -Xcompiler -fvisibility=hidden -Icore -lineinfo \
           $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
           -gencode arch=compute_$(lastword $(CUDA_ARCHS)),code=compute_$(lastword $(CUDA_ARCHS))

ifeq ($(CUDA),1)
  ifeq ($(wildcard $(NCCL_HOME)/include/nccl.h),)
    $(error CUDA=1 builds the NCCL communicator (cuda/comm.cu), but $(NCCL_HOME)/include/nccl.h is missing: set NCCL_HOME to NCCL's prefix, or build with CUDA=0)
  endif
  CFLAGS += -DKD_WITH_CUDA
  NVFLAGS += -I$(NCCL_HOME)/include
  OBJ := $(CORE_OBJ) $(CUDA_OBJ)
  LDLIBS += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lcublas -lcublasLt -lstdc++ \
            -L$(NCCL_HOME)/lib64 -Wl,-rpath,$(NCCL_HOME)/lib64 -lnccl -ldl
else
  OBJ := $(CORE_OBJ)
endif

LUAJIT  := luajit
# Debian's busted script starts with `#!/usr/bin/env lua`: run it under LuaJIT
BUSTED  := $(LUAJIT) $(shell command -v busted 2>/dev/null || echo /usr/bin/busted)
DEB_PKGS := luajit libluajit-5.1-dev lua-busted lua-dkjson libcjson-dev libpcre2-dev libreadline8 pkg-config g++
FUZZ_PKGS := clang python3

.PHONY: all test test-gpu test-asan fuzz fuzz-build deps-fuzz run bench bench-trace bench-comm deps install clean FORCE
all: $(BUILD)/libkdtree.so $(BUILD)/libkdtree_test.so $(BUILD)/libkdtree_internal.a

# The configuration of this build, rewritten (and so newer than every object) only when it
# changes: objects depend on it, so `make CUDA=0` then `make` cannot link CPU-built objects
# into a CUDA library. Each make says which backends it builds and how to change that.
CONFIG := CUDA=$(CUDA) CC=$(CC) SAN=$(SAN) CFLAGS=$(CFLAGS)$(if $(filter 1,$(CUDA)), CUDA_ARCHS=$(CUDA_ARCHS) NVFLAGS=$(NVFLAGS))
STAMP  := $(BUILD)/config.stamp
ifeq ($(CUDA),1)
  BACKENDS_MSG := cpu + cuda (sm $(CUDA_ARCHS), $(NVCC)); CPU only: make CUDA=0; other GPUs: make CUDA_ARCHS="90 120"
else
  BACKENDS_MSG := cpu only$(if $(NVCC),, (no nvcc found)); with CUDA: make CUDA=1 (CUDA_ARCHS="90 120" picks the GPUs)
endif
$(STAMP): FORCE
	@mkdir -p $(BUILD)
	@echo 'kdtree: backends $(BACKENDS_MSG)'
	@if ! echo '$(CONFIG)' | cmp -s - $@; then \
	  [ -f $@ ] && echo 'kdtree: the configuration changed: rebuilding every object'; echo '$(CONFIG)' > $@; fi

# the version script: every function declared in kdtree.h (a declaration starts a line with its
# return type; comments and continuation lines start with a blank or '/'), all else local
$(BUILD)/kdtree.map: core/kdtree.h
	@mkdir -p $(dir $@)
	{ echo '{ global:'; sed -n 's/^[a-z][^(]*[ *]\(kd_[a-z0-9_]*\)(.*/  \1;/p' $<; echo 'local: *; };'; } > $@

# SONAME libkdtree.so.$(SOVERSION); the build directory's link of that name lets programs
# linked against build/libkdtree.so run from there
$(BUILD)/libkdtree.so: $(OBJ) $(BUILD)/kdtree.map
	$(CC) $(SAN) -shared -Wl,-soname,libkdtree.so.$(SOVERSION) -Wl,--version-script=$(BUILD)/kdtree.map -o $@ $(OBJ) $(LDLIBS)
	@ln -sf libkdtree.so $(BUILD)/libkdtree.so.$(SOVERSION)

# the test library's version script: kdtree.h's functions plus the test surface, all else local
# (the CUDA objects would otherwise export C++ runtime symbols such as _ZTVSt9type_info)
$(BUILD)/kdtree_test.map: $(BUILD)/kdtree.map
	sed 's/^local:/  kd_test_*; kd_testing_*;\nlocal:/' $< > $@

$(BUILD)/libkdtree_test.so: $(OBJ) $(TEST_OBJ) $(BUILD)/kdtree_test.map
	$(CC) $(SAN) -shared -Wl,--version-script=$(BUILD)/kdtree_test.map -o $@ $(OBJ) $(TEST_OBJ) $(LDLIBS)

# the engine's objects for programs that reach inside it (benches: backend ops, config, weights),
# linked statically with the flags written beside it (engine.flags: KD_WITH_CUDA when the
# objects have the CUDA backend, the sanitizers they were built with, and the libraries)
$(BUILD)/libkdtree_internal.a: $(OBJ)
	rm -f $@ && ar rcs $@ $^
	echo $(filter -DKD_WITH_CUDA,$(CFLAGS)) $(SAN) $(LDLIBS) > $(BUILD)/engine.flags

$(BUILD)/core/%.o: core/%.c $(wildcard core/*.h core/cpu/*.h) $(STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(HIDDEN) -c -o $@ $<

$(BUILD)/spec/c/%.o: spec/c/%.c $(wildcard core/*.h core/cpu/*.h spec/c/*.h) $(STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Ispec/c -c -o $@ $<

$(BUILD)/%.o: %.cu $(wildcard core/*.h cuda/*.cuh) $(STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c -o $@ $<

# deps: the Debian packages (g++ builds the CUDA kernels' CPU emulation, spec/norm_emu_spec.lua); as
# root install them, otherwise print the command.
# deps-fuzz: the same for what `make fuzz` needs besides (clang's libFuzzer, python3 for the seeds)
install_pkgs = @missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "missing packages:$$missing"; echo "run: sudo apt-get install -y$$missing"; exit 1; fi; fi
deps:
	$(call install_pkgs,$(DEB_PKGS))
deps-fuzz: deps
	$(call install_pkgs,$(FUZZ_PKGS))

# run and test build in parallel ($(JOBS) jobs: the CUDA fat binary takes minutes serially);
# the specs load libkdtree_test.so (the library plus spec/c's test surface)
test: deps
	@$(MAKE) --no-print-directory -j$(JOBS) all $(EXAMPLE)
	$(EXAMPLE) $(RUN_MODEL) $(RUN_DRAFT)
	KDTREE_LIB=$(BUILD)/libkdtree_test.so $(BUSTED) --exclude-tags=gpu,slow spec

# test-asan: the CPU suite against the library built with ASan + UBSan (every report fatal) in
# $(BUILD)/asan; LuaJIT is not instrumented, so the ASan runtime is preloaded into it, and
# LeakSanitizer checks at each process's exit (busted's, and every CLI the specs run; the C
# toolchain a spec runs is suppressed: scripts/sanitize/lsan.supp).
ASAN_SAN := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
ASAN_ENV := LD_PRELOAD=$$($(CC) -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=1 \
            LSAN_OPTIONS=suppressions=$(CURDIR)/scripts/sanitize/lsan.supp:print_suppressions=0 \
            UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
test-asan: deps
	$(MAKE) --no-print-directory -j$(JOBS) CUDA=0 BUILD=$(BUILD)/asan SAN="$(ASAN_SAN)" all
	$(ASAN_ENV) KDTREE_LIB=$(BUILD)/asan/libkdtree_test.so $(BUSTED) --exclude-tags=gpu,slow spec

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

test-gpu:
	@$(MAKE) --no-print-directory -j$(JOBS) all $(EXAMPLE)
	$(EXAMPLE) $(RUN_MODEL) $(RUN_DRAFT) cuda
	KDTREE_LIB=$(BUILD)/libkdtree_test.so KDTREE_BACKEND=cuda $(BUSTED) spec

run: deps
	@$(MAKE) --no-print-directory -j$(JOBS) all
	printf 'def read_json(path):\n    """Read a JSON file and return its contents."""\n' | \
	  KDTREE_LIB=$(BUILD)/libkdtree.so $(LUAJIT) scripts/kdtree generate --model $(RUN_MODEL) \
	  --draft $(RUN_DRAFT) --policy ddtree --budget 16 --prompt - -n 64 --compare-ar

# the C API's example program: a whole DDTree decode against kdtree.h (docs/c-api.md)
EXAMPLE := $(BUILD)/examples/ddtree
$(EXAMPLE): scripts/examples/ddtree.c core/kdtree.h $(BUILD)/libkdtree.so
	@mkdir -p $(dir $@)
	$(CC) -O2 -std=c11 -Wall -Wextra -Icore -o $@ $< -L$(BUILD) -lkdtree -Wl,-rpath,$(abspath $(BUILD))

# bench (GPU machine, one run): the W4A16 program first (ceilings measured in the same run:
# D2D copy, a read-only kernel, cuBLAS bf16 8192^3; fp64 checks; GEMM and MoE timings; it
# needs only cuda/w4a16.cu, cuda/w4a16_skinny.cu, core/error.c and cuBLAS), then the backend's op timings
# (dense linear, MLA attention, tree top-k, and the DDTree round table: $(BUILD)/bench/ddtree_round.md)
# when the whole library builds.
# Tables: $(BUILD)/bench/w4a16.md (copied into docs/performance-log.md by hand, with the date; the current numbers into docs/performance.md).
BENCH_W4 := $(BUILD)/bench/w4a16_bench
W4_OBJS := $(BUILD)/cuda/w4a16.o $(BUILD)/cuda/w4a16_skinny.o $(BUILD)/core/error.o
$(BENCH_W4): scripts/bench/w4a16_bench.cu cuda/w4a16.cuh $(W4_OBJS)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -Xcompiler -fopenmp -o $@ $< $(W4_OBJS) -lcublas -lgomp

# Then the decode step of a K2.6-dims model slice (1 dense + 3 MoE layers, random weights built
# in memory) against its weight-bytes roofline, and the MLA attention rows: $(BUILD)/bench/model_slice.md.
BENCH_SLICE := $(BUILD)/bench/model_slice_bench
# The benches that reach inside the engine (backend ops, config, weights) link its objects: the
# shared library exports only kdtree.h.
$(BENCH_SLICE): scripts/bench/model_slice_bench.c scripts/bench/slice_draft.c scripts/bench/slice_cuda.cu scripts/bench/slice_cuda.h \
                $(BUILD)/libkdtree_internal.a
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c -o $(BUILD)/bench/slice_cuda.o scripts/bench/slice_cuda.cu
	$(CC) -O2 -g -std=c11 -D_GNU_SOURCE $(filter -DKD_WITH_CUDA,$(CFLAGS)) -DKD_SLICE_EVENTS -Icore -Iscripts/bench \
	  scripts/bench/model_slice_bench.c $(BUILD)/bench/slice_cuda.o $(BUILD)/libkdtree_internal.a $(LDLIBS) -lnccl -ldl -o $@

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

# The communicator (cuda/comm.cu) on the GPUs there are: the loopback with 2, 4 and 8 ranks on device 0
# checked against a host fp32 fold, NCCL with 1 rank (and with every GPU when there are several),
# NCCL captured in a graph, and all-reduce timings for 1..256 rows of 7168 bf16: $(BUILD)/bench/comm.md.
# Linked with the engine's objects (libkdtree_internal.a): kd_comm_cuda_create is not in kdtree.h.
BENCH_COMM := $(BUILD)/bench/comm_bench
$(BENCH_COMM): scripts/bench/comm_bench.c $(BUILD)/libkdtree_internal.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $< $(BUILD)/libkdtree_internal.a $(LDLIBS)
bench-comm: $(BENCH_COMM)
	$(BENCH_COMM) --md $(BUILD)/bench/comm.md

# The backend ops one by one and the DDTree round around verify (tree build, accept, commit):
# $(BUILD)/bench/ddtree_round.md.
BENCH_OPS := $(BUILD)/bench/cuda_ops_bench
$(BENCH_OPS): scripts/bench/cuda_ops_bench.c $(BUILD)/libkdtree_internal.a
	@mkdir -p $(dir $@)
	$(CC) -O2 -std=c11 -D_GNU_SOURCE -Wall -Icore -I$(CUDA_HOME)/include $< $(BUILD)/libkdtree_internal.a $(LDLIBS) -o $@

bench: $(BENCH_W4)
	$(BENCH_W4) --md $(BUILD)/bench/w4a16.md
	-$(MAKE) $(BENCH_OPS) && $(BENCH_OPS) --md $(BUILD)/bench/ddtree_round.md
	-$(MAKE) $(BENCH_SLICE) && $(BENCH_SLICE) --md $(BUILD)/bench/model_slice.md
	-$(MAKE) bench-comm
	-mkdir -p $(BUILD)/bench && KDTREE_LIB=$(BUILD)/libkdtree.so $(LUAJIT) scripts/bench/memory_report.lua --md $(BUILD)/bench/memory.md

# install: the library (libkdtree.so.VERSION, with the SONAME link and the development link), the
# header, kdtree.pc, the Lua modules under share/lua/5.1 (LuaJIT's own search path for
# /usr/local and /usr), the CLI and the shipped models; then a line on LUA_PATH when this
# LuaJIT would not find the modules under PREFIX.
LUA_DIR := $(PREFIX)/share/lua/5.1
install: all
	install -d $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/bin \
	  $(DESTDIR)$(LUA_DIR)/kdtree/policy $(DESTDIR)$(LUA_DIR)/kdtree/drafters \
	  $(DESTDIR)$(PREFIX)/share/kdtree/models
	install -m 755 $(BUILD)/libkdtree.so $(DESTDIR)$(PREFIX)/lib/libkdtree.so.$(VERSION)
	ln -sf libkdtree.so.$(VERSION) $(DESTDIR)$(PREFIX)/lib/libkdtree.so.$(SOVERSION)
	ln -sf libkdtree.so.$(SOVERSION) $(DESTDIR)$(PREFIX)/lib/libkdtree.so
	install -m 644 core/kdtree.h $(DESTDIR)$(PREFIX)/include/
	printf 'prefix=%s\nlibdir=$${prefix}/lib\nincludedir=$${prefix}/include\n\nName: kdtree\nDescription: %s\nVersion: %s\nLibs: -L$${libdir} -lkdtree\nCflags: -I$${includedir}\n' \
	  '$(PREFIX)' 'Kimi K2.6 inference with DDTree speculative decoding' '$(VERSION)' \
	  > $(DESTDIR)$(PREFIX)/lib/pkgconfig/kdtree.pc
	install -m 644 lua/kdtree/*.lua $(DESTDIR)$(PREFIX)/share/lua/5.1/kdtree/
	install -m 644 lua/kdtree/policy/*.lua $(DESTDIR)$(PREFIX)/share/lua/5.1/kdtree/policy/
	install -m 644 lua/kdtree/drafters/*.lua $(DESTDIR)$(PREFIX)/share/lua/5.1/kdtree/drafters/
	install -m 755 scripts/kdtree $(DESTDIR)$(PREFIX)/bin/kdtree
	cp -r models/mini-code models/mini-code-dflash models/tiny-k2.6 models/tiny-k2.6-dflash \
	  $(DESTDIR)$(PREFIX)/share/kdtree/models/
	@if ! $(LUAJIT) -e 'os.exit(package.path:find("$(LUA_DIR)/?.lua", 1, true) and 0 or 1)' 2>/dev/null; then \
	  echo 'kdtree: $(LUAJIT) does not search $(LUA_DIR); for require("kdtree") add to your shell profile:'; \
	  echo '  export LUA_PATH="$(LUA_DIR)/?.lua;$(LUA_DIR)/?/init.lua;;"'; fi

clean:
	rm -rf $(BUILD)
