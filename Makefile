# tinymoe — build
#
#   make                      libtinymoe.a, libtinymoe.so and the tinymoe driver in build/
#   make test                 check the .so's exports (scripts/check-exports.sh) and the layers'
#                             include boundary (scripts/check-boundary.sh), build and run
#                             the Criterion suite (tests/), then examples/*.c against a staged
#                             install ($(BUILD)/stage)
#   make SAN=1 test           the same with AddressSanitizer + UBSan (objects in build-san/)
#   make test-cuda            on a GPU machine: tests/gpu/run.sh (builds with CUDA=1 BLAS=0, runs
#                             the Criterion suite, the Hugging Face check and tests/gpu/e2e.sh)
#   make install PREFIX=/usr/local
#
# Auto-detected, override on the command line:
#   CUDA=0|1      nvcc found (PATH or $(CUDA_HOME)/bin)      -> CUDA backend (cudart, cuBLASLt)
#   BLAS=0|1      pkg-config openblas found                   -> CPU GEMM through CBLAS
#   MPI=0|1       mpicc found                                 -> distributed training (framework/comm_mpi.c)
#   NCCL=0|1      CUDA, MPI and nccl.h + libnccl.so found     -> NCCL for CUDA tensors (kernels/cuda/comm_nccl.cu)
#   CUDA_ARCH     nvcc -gencode list (default sm_80, sm_90, PTX compute_90); CUDA_ARCH_SM90A the
#                 list of kernels/cuda/*_sm90.cu (default sm_80, sm_90a)

CC       ?= cc
PREFIX   ?= /usr/local
CUDA_HOME ?= /usr/local/cuda
SAN      ?= 0

NVCC := $(shell command -v nvcc 2>/dev/null || { test -x $(CUDA_HOME)/bin/nvcc && echo $(CUDA_HOME)/bin/nvcc; })
ifeq ($(origin CUDA),undefined)
  CUDA := $(if $(NVCC),1,0)
endif
# Prefer the OpenMP build of OpenBLAS: its threads are our OpenMP pool, so BLAS calls and our
# kernels never fight for cores (with the pthreads build, idle OpenMP workers spin while
# OpenBLAS's own threads wait: a 3x slowdown seen on 2 cores). Override with BLAS_PC=<dir>.
BLAS_PC ?= $(firstword $(wildcard /usr/lib/*/openblas-openmp/pkgconfig))
BLAS_PKG := $(if $(BLAS_PC),PKG_CONFIG_PATH=$(BLAS_PC) ,)pkg-config
ifeq ($(origin BLAS),undefined)
  BLAS := $(shell $(BLAS_PKG) --exists openblas 2>/dev/null && echo 1 || echo 0)
endif
ifeq ($(origin MPI),undefined)
  MPI := $(shell command -v mpicc >/dev/null 2>&1 && echo 1 || echo 0)
endif

ifeq ($(SAN),1)
  BUILD := build-san
  SANFLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
  OPT := -O1 -g
else
  BUILD := build
  SANFLAGS :=
  OPT := -O2 -g
endif

WARN     := -Wall -Wextra -Werror -Wno-unused-parameter
CFLAGS_ALL := -std=c11 -D_GNU_SOURCE $(OPT) $(WARN) -fPIC -fopenmp -Iinclude $(SANFLAGS) $(CFLAGS)
LDLIBS_ALL := -fopenmp -lm -lpthread -lz $(SANFLAGS)

ifeq ($(BLAS),1)
  BLAS_LIBS := $(shell $(BLAS_PKG) --libs openblas)
  CFLAGS_ALL += -DTM_HAVE_CBLAS $(shell $(BLAS_PKG) --cflags openblas)
  LDLIBS_ALL += $(BLAS_LIBS) -Wl,-rpath,$(patsubst -L%,%,$(filter -L%,$(BLAS_LIBS)))
  PC_LIBS_PRIVATE += $(BLAS_LIBS) -Wl,-rpath,$(patsubst -L%,%,$(filter -L%,$(BLAS_LIBS)))
endif
# MPI (framework/comm_mpi.c): Open MPI's compile and link flags from its compiler wrapper; MPI_CFLAGS /
# MPI_LIBS override them (another MPI: `mpicc -show`). MPI=0 builds a single-process library.
MPICC ?= mpicc
ifeq ($(MPI),1)
  ifeq ($(origin MPI_CFLAGS),undefined)
    MPI_CFLAGS := $(shell $(MPICC) --showme:compile 2>/dev/null)
  endif
  ifeq ($(origin MPI_LIBS),undefined)
    MPI_LIBS := $(shell $(MPICC) --showme:link 2>/dev/null)
  endif
  CFLAGS_ALL += -DTM_HAVE_MPI
  LDLIBS_ALL += $(MPI_LIBS)
  PC_LIBS_PRIVATE += $(MPI_LIBS)
  COMM_SRC := framework/comm_mpi.c
else
  COMM_SRC :=
endif
# cJSON (Debian libcjson-dev) reads JSON for the driver (train/hf.c) and its tests; libtinymoe
# does not use it. Override CJSON_CFLAGS / CJSON_LIBS where pkg-config cannot find it.
ifeq ($(origin CJSON_LIBS),undefined)
  CJSON_LIBS := $(shell pkg-config --libs libcjson 2>/dev/null)
endif
ifeq ($(origin CJSON_CFLAGS),undefined)
  CJSON_CFLAGS := $(shell pkg-config --cflags libcjson 2>/dev/null)
endif
# PCRE2 (Debian libpcre2-dev, its 8-bit library) runs the regex pre-tokenizers of subword
# tokenizers for the driver (train/bpe_pretok.c) and its tests; libtinymoe does not use it.
# Override PCRE2_CFLAGS / PCRE2_LIBS where pkg-config cannot find it.
ifeq ($(origin PCRE2_LIBS),undefined)
  PCRE2_LIBS := $(shell pkg-config --libs libpcre2-8 2>/dev/null)
endif
ifeq ($(origin PCRE2_CFLAGS),undefined)
  PCRE2_CFLAGS := $(shell pkg-config --cflags libpcre2-8 2>/dev/null)
endif
# utf8proc (Debian libutf8proc-dev) normalizes text to NFC for the subword tokenizers whose
# tokenizer.json asks for it (Qwen2's; train/bpe_norm.c) in the driver and its tests; libtinymoe
# does not use it. Override UTF8PROC_CFLAGS / UTF8PROC_LIBS where pkg-config cannot find it.
ifeq ($(origin UTF8PROC_LIBS),undefined)
  UTF8PROC_LIBS := $(shell pkg-config --libs libutf8proc 2>/dev/null)
endif
ifeq ($(origin UTF8PROC_CFLAGS),undefined)
  UTF8PROC_CFLAGS := $(shell pkg-config --cflags libutf8proc 2>/dev/null)
endif

CUDA_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
             -gencode arch=compute_90,code=compute_90
ifeq ($(CUDA),1)
  ifeq ($(NVCC),)
    $(error CUDA=1 but nvcc was not found (PATH or $(CUDA_HOME)/bin))
  endif
  CFLAGS_ALL += -DTM_HAVE_CUDA -I$(CUDA_HOME)/include
  NVCCFLAGS := -std=c++17 -O2 -g -lineinfo $(CUDA_ARCH) -Xcompiler -fPIC,-Wall,-Werror,-fvisibility=hidden \
               -Werror all-warnings -DTM_HAVE_CUDA -Iinclude -Iframework
  CUDA_LIBDIR := $(CUDA_HOME)/lib64
  LDLIBS_ALL += -L$(CUDA_LIBDIR) -Wl,-rpath,$(CUDA_LIBDIR) -lcublasLt -lcudart -lstdc++
  PC_LIBS_PRIVATE += -L$(CUDA_LIBDIR) -Wl,-rpath,$(CUDA_LIBDIR) -lcublasLt -lcudart -lstdc++
  CU_SRC := $(filter-out kernels/cuda/comm_nccl.cu,$(wildcard kernels/cuda/*.cu))
else
  CU_SRC :=
endif
# NCCL (kernels/cuda/comm_nccl.cu): collectives on CUDA tensors, in builds with CUDA and MPI (the unique ids
# travel over MPI). Found beside the CUDA toolkit ($(CUDA_HOME)) or in the system directories
# (Debian's libnccl-dev); NCCL=0 leaves CUDA tensors to the host-staged MPI engine.
NCCL_H := $(firstword $(wildcard $(CUDA_HOME)/include/nccl.h /usr/include/nccl.h))
NCCL_SO := $(firstword $(wildcard $(CUDA_HOME)/lib64/libnccl.so /usr/lib/x86_64-linux-gnu/libnccl.so /usr/lib64/libnccl.so))
ifeq ($(origin NCCL),undefined)
  NCCL := $(if $(and $(filter 1,$(CUDA)),$(filter 1,$(MPI)),$(NCCL_H),$(NCCL_SO)),1,0)
endif
ifeq ($(NCCL),1)
  NCCL_LIBDIR := $(patsubst %/,%,$(dir $(NCCL_SO)))
  CFLAGS_ALL += -DTM_HAVE_NCCL
  NVCCFLAGS += -DTM_HAVE_NCCL -I$(dir $(NCCL_H))
  LDLIBS_ALL += -L$(NCCL_LIBDIR) -Wl,-rpath,$(NCCL_LIBDIR) -lnccl
  PC_LIBS_PRIVATE += -L$(NCCL_LIBDIR) -Wl,-rpath,$(NCCL_LIBDIR) -lnccl
  CU_SRC += kernels/cuda/comm_nccl.cu
endif

LIB_SRC  := $(filter-out framework/comm_mpi.c,$(wildcard framework/*.c framework/ops/*.c kernels/cpu/*.c layers/*.c optim/*.c checkpoints/*.c)) $(COMM_SRC)
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/%.o) $(CU_SRC:%.cu=$(BUILD)/%.cu.o)

# The library's boundary: libtinymoe.so exports the public API (include/tinymoe.h) and nothing
# else. Every library object, C and CUDA, is compiled with -fvisibility=hidden, and the header
# marks each public function TM_API (visibility "default"), as ggml does with GGML_API. This
# is done in the compiler rather than with a linker version script because it needs no name
# pattern (a `tm_*` glob would also match the tm__ internals), and because it also holds for
# libtinymoe.a: a program that links the archive into its own shared library re-exports only
# the public names, never tm__ ones. Hidden internals also let the compiler call them directly,
# without the PLT. The two libraries are built from the same objects, so tests linking
# libtinymoe.a still reach tm__ functions (hidden is a dynamic-linking property only).
# scripts/check-exports.sh, run by `make test` (and `make check-exports`), fails when the .so
# exports a tm__ or other non-public name, or misses a public one (a function without TM_API).
LIB_VIS := -fvisibility=hidden
# Only the library and the tests see framework/ (internal.h); the driver (train/) and bench/
# are built against include/ alone, as any program using the library is.
$(LIB_SRC:%.c=$(BUILD)/%.o): CFLAGS_ALL += $(LIB_VIS) -Iframework
$(COMM_SRC:%.c=$(BUILD)/%.o): CFLAGS_ALL += $(MPI_CFLAGS)
# The driver: train/main.c plus the rest of train/ (data, config, ...), which the tests link
# too, through libtinymoe_train.a.
DRV_SRC  := $(filter-out train/main.c,$(wildcard train/*.c))
DRV_OBJ  := $(DRV_SRC:%.c=$(BUILD)/%.o)
DRV_MAIN := $(BUILD)/train/main.o
TEST_SRC := $(wildcard tests/*.c)
TEST_OBJ := $(TEST_SRC:%.c=$(BUILD)/%.o)

LIBA  := $(BUILD)/libtinymoe.a
LIBTRAIN := $(BUILD)/libtinymoe_train.a
LIBSO := $(BUILD)/libtinymoe.so
TM_VERSION := $(shell sed -n 's/^\#define TM_VERSION_STRING "\(.*\)"/\1/p' include/tinymoe.h)
SONAME := libtinymoe.so.$(firstword $(subst ., ,$(TM_VERSION)))
BIN   := $(BUILD)/tinymoe
TESTBIN := $(BUILD)/tinymoe_tests
DIST_HELPER := $(BUILD)/tinymoe_dist_helper

.PHONY: all test install clean config cjson-check pcre2-check utf8proc-check
all: $(LIBA) $(LIBSO) $(BIN)

config:
	@echo "CUDA=$(CUDA) BLAS=$(BLAS) ($(BLAS_PKG) openblas) MPI=$(MPI) NCCL=$(NCCL) SAN=$(SAN) BUILD=$(BUILD) NVCC=$(NVCC) CJSON_LIBS=$(CJSON_LIBS) PCRE2_LIBS=$(PCRE2_LIBS) UTF8PROC_LIBS=$(UTF8PROC_LIBS)"

cjson-check:
	@test -n "$(strip $(CJSON_LIBS))" || { echo "Makefile: cJSON not found (pkg-config libcjson): install libcjson-dev (scripts/install-deps.sh), or set CJSON_CFLAGS and CJSON_LIBS" >&2; exit 1; }

pcre2-check:
	@test -n "$(strip $(PCRE2_LIBS))" || { echo "Makefile: PCRE2 not found (pkg-config libpcre2-8): install libpcre2-dev (scripts/install-deps.sh), or set PCRE2_CFLAGS and PCRE2_LIBS" >&2; exit 1; }

utf8proc-check:
	@test -n "$(strip $(UTF8PROC_LIBS))" || { echo "Makefile: utf8proc not found (pkg-config libutf8proc): install libutf8proc-dev (scripts/install-deps.sh), or set UTF8PROC_CFLAGS and UTF8PROC_LIBS" >&2; exit 1; }

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -MMD -MP -c $< -o $@

$(BUILD)/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

# The Hopper grouped GEMM and attention (wgmma, TMA, setmaxnreg) need the sm_90a feature set, and
# an sm_90 or PTX image of them beside would leave the driver a choice of an empty kernel: these
# files get sm_80 (any other GPU: their host code says no and the callers keep their own kernels)
# and sm_90a instead of CUDA_ARCH.
CUDA_ARCH_SM90A ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90a,code=sm_90a
$(BUILD)/kernels/cuda/grouped_matmul_sm90.cu.o $(BUILD)/kernels/cuda/attention_sm90.cu.o: \
    NVCCFLAGS := $(subst $(CUDA_ARCH),$(CUDA_ARCH_SM90A),$(NVCCFLAGS))

$(LIBA): $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

# --exclude-libs,ALL: symbols of static archives linked into the .so (a toolchain whose
# libstdc++ is only an archive, as on the GPU machine) stay local, so the .so still exports
# nothing but the public tm_ names.
# The SONAME carries the major version (libtinymoe.so.0): a program linked against it keeps
# finding a compatible library after a minor upgrade, and refuses an incompatible one. The
# build tree has the SONAME link beside the library, so programs linked here run from it.
$(LIBSO): $(LIB_OBJ)
	$(CC) -shared -Wl,--exclude-libs,ALL -Wl,-soname,$(SONAME) -o $@ $^ $(LDLIBS_ALL)
	@ln -sf libtinymoe.so $(BUILD)/$(SONAME)

$(LIBTRAIN): $(DRV_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/train/%.o: CFLAGS_ALL += $(CJSON_CFLAGS) $(PCRE2_CFLAGS) $(UTF8PROC_CFLAGS)
$(DRV_OBJ) $(DRV_MAIN): | cjson-check pcre2-check utf8proc-check
$(BIN): $(DRV_MAIN) $(LIBTRAIN) $(LIBA)
	$(CC) -o $@ $(DRV_MAIN) $(LIBTRAIN) $(LIBA) $(LDLIBS_ALL) $(CJSON_LIBS) $(PCRE2_LIBS) $(UTF8PROC_LIBS)

$(BUILD)/tests/%.o: CFLAGS_ALL += $(shell pkg-config --cflags criterion 2>/dev/null) -Itests
$(BUILD)/tests/%.o: CFLAGS_ALL += -Iframework -Itrain $(CJSON_CFLAGS)
$(TEST_OBJ): | cjson-check pcre2-check utf8proc-check
$(TESTBIN): $(TEST_OBJ) $(LIBTRAIN) $(LIBA) | $(DIST_HELPER) $(BIN)
	$(CC) -o $@ $(TEST_OBJ) $(LIBTRAIN) $(LIBA) $(LDLIBS_ALL) $(CJSON_LIBS) $(PCRE2_LIBS) $(UTF8PROC_LIBS) $(shell pkg-config --libs criterion 2>/dev/null || echo -lcriterion)

# The SPMD program that tests/test_dist.c runs under mpirun (next to the test binary), and the
# driver those tests train with.
$(DIST_HELPER): tests/dist/dist_helper.c $(LIBA)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -o $@ $< $(LIBA) $(LDLIBS_ALL)

# ASan and the CUDA runtime disagree about the shadow gap; UBSan prints stacks.
TEST_ENV := ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
test: check-exports check-boundary $(TESTBIN) $(BIN)
	$(TEST_ENV) $(abspath $(TESTBIN)) --jobs 2 $(TEST_ARGS)
	@$(MAKE) --no-print-directory examples
	@python3 bench/step_kernels.py --self-test
	@$(if $(filter 1,$(SAN)),,$(MAKE) --no-print-directory readme)

# The README's shell blocks that need no GPU, run in order in a scratch directory as a new user
# would (scripts/check-readme.sh says what it skips and the one change: train steps capped).
# Not under SAN=1: it checks the commands, not the memory, and the plain run covers them.
.PHONY: readme
readme: $(BIN)
	scripts/check-readme.sh $(BUILD)

# The GPU machine's run (see tests/gpu/run.sh): its own build, the suite, then the driver end to end.
.PHONY: test-cuda
test-cuda:
	bash tests/gpu/run.sh

# libtinymoe.so exports exactly the TM_API functions of libtinymoe.a (see LIB_VIS above).
.PHONY: check-exports
check-exports: $(LIBSO) $(LIBA)
	scripts/check-exports.sh $(LIBSO) $(LIBA)

# layers/, optim/ and checkpoints/ include only tinymoe.h and framework/extend.h (no other
# framework/ header): scripts/check-boundary.sh, run by `make test`.
.PHONY: check-boundary
check-boundary:
	scripts/check-boundary.sh

# Every examples/*.c, built the way a user would, by the line its header comment gives: against a
# staged install (its header and its pkg-config file, not the tree's), linked to the shared
# library through an rpath to pkg-config's libdir, checked to need the SONAME, and run in
# $(BUILD)/examples (where they may write files). Under SAN=1 they are compiled with the same
# sanitizers, since an instrumented libtinymoe.so needs the ASan runtime loaded first.
STAGE := $(abspath $(BUILD))/stage
EXAMPLE_SRC := $(wildcard examples/*.c)
.PHONY: examples
examples:
	@$(MAKE) --no-print-directory install PREFIX=$(STAGE) DESTDIR= >/dev/null
	@mkdir -p $(BUILD)/examples
	@set -e; for src in $(EXAMPLE_SRC); do \
	  exe=$(abspath $(BUILD))/examples/$$(basename $$src .c); \
	  echo "example: $$src (against $(STAGE))"; \
	  $(CC) -std=c11 $(OPT) -Wall -Wextra -Werror $(SANFLAGS) \
	    $$(PKG_CONFIG_PATH=$(STAGE)/lib/pkgconfig pkg-config --cflags tinymoe) $$src -o $$exe \
	    $$(PKG_CONFIG_PATH=$(STAGE)/lib/pkgconfig pkg-config --libs tinymoe) \
	    -Wl,-rpath,$$(PKG_CONFIG_PATH=$(STAGE)/lib/pkgconfig pkg-config --variable=libdir tinymoe); \
	  readelf -d $$exe | grep -q 'NEEDED.*\[$(SONAME)\]' || { echo "$$exe does not need $(SONAME)" >&2; exit 1; }; \
	  (cd $(BUILD)/examples && $(TEST_ENV) $$exe); \
	done
	@if command -v cmake >/dev/null 2>&1 && [ -z "$(filter 1,$(SAN))" ]; then \
	  echo "example: examples/hello.c through find_package(tinymoe) (CMake, shared and static)"; \
	  scripts/check-cmake.sh $(STAGE) $(abspath $(BUILD))/examples/cmake; \
	else echo "example: CMake package check skipped (no cmake, or SAN=1)"; fi

PC := $(BUILD)/tinymoe.pc
# Rewritten on every install (only when its text changes), so it always names this PREFIX.
$(PC): FORCE
	@mkdir -p $(BUILD)
	@printf 'prefix=%s\nlibdir=$${prefix}/lib\nincludedir=$${prefix}/include\n\nName: tinymoe\nDescription: embeddable MoE training microframework\nVersion: %s\nLibs: -L$${libdir} -ltinymoe\nLibs.private: -fopenmp -lm -lpthread -lz %s\nCflags: -I$${includedir}\n' \
	  '$(PREFIX)' "$$(sed -n 's/^#define TM_VERSION_STRING "\(.*\)"/\1/p' include/tinymoe.h)" '$(PC_LIBS_PRIVATE)' > $@.tmp
	@cmp -s $@.tmp $@ && rm -f $@.tmp || mv -f $@.tmp $@
.PHONY: FORCE
FORCE:

CMAKE_CFG := $(BUILD)/cmake
install: all $(PC)
	@scripts/cmake-config.sh $(CMAKE_CFG) $(TM_VERSION) '-fopenmp -lm -lpthread -lz $(PC_LIBS_PRIVATE)'
	install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/bin \
	  $(DESTDIR)$(PREFIX)/lib/cmake/tinymoe
	install -m 644 $(CMAKE_CFG)/tinymoeConfig.cmake $(CMAKE_CFG)/tinymoeConfigVersion.cmake \
	  $(DESTDIR)$(PREFIX)/lib/cmake/tinymoe/
	install -m 644 include/tinymoe.h $(DESTDIR)$(PREFIX)/include/
	install -m 644 $(LIBA) $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(LIBSO) $(DESTDIR)$(PREFIX)/lib/libtinymoe.so.$(TM_VERSION)
	ln -sf libtinymoe.so.$(TM_VERSION) $(DESTDIR)$(PREFIX)/lib/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(PREFIX)/lib/libtinymoe.so
	install -m 644 $(PC) $(DESTDIR)$(PREFIX)/lib/pkgconfig/
	install -m 755 $(BIN) $(DESTDIR)$(PREFIX)/bin/

clean:
	rm -rf build build-san

-include $(LIB_OBJ:.o=.d) $(DRV_OBJ:.o=.d) $(DRV_MAIN:.o=.d) $(TEST_OBJ:.o=.d)

# ---- benchmark (bench/) --------------------------------------------------------------------
# `make bench`: tinymoe's CPU training throughput beside PyTorch's on the same model
# (bench/run.sh; BENCH_ARGS passes options to it, e.g. BENCH_ARGS='--threads 2 --steps 30').
BENCH_BIN := $(BUILD)/bench/train_cpu
$(BENCH_BIN): bench/train_cpu.c $(LIBA)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -o $@ $< $(LIBA) $(LDLIBS_ALL)

# bench/alltoall.c (MPI builds): tinymoe's ragged all-to-all against NCCL send/recv (CUDA) or
# MPI_Alltoallv (CPU) of the same bytes: mpirun -np N $(BUILD)/bench_alltoall [--device cpu].
ifeq ($(MPI),1)
$(BUILD)/bench_alltoall: bench/alltoall.c $(LIBA)
	$(CC) $(CFLAGS_ALL) $(MPI_CFLAGS) -o $@ $< $(LIBA) $(LDLIBS_ALL)
bench-tools: $(BUILD)/bench_alltoall
endif
# bench/cudatrace.c (CUDA builds): an LD_PRELOAD library that counts and times the CUDA runtime
# and cuBLASLt calls of a program (where the host's time goes, without Nsight Systems).
ifeq ($(CUDA),1)
$(BUILD)/libcudatrace.so: bench/cudatrace.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -O2 -g $(WARN) -fPIC -shared -I$(CUDA_HOME)/include -o $@ $< -ldl
bench-tools: $(BUILD)/libcudatrace.so
all: $(BUILD)/libcudatrace.so
# bench/gmm_sm90_harness.cu: the Hopper grouped GEMM alone (no library), checked against cuBLAS per
# group and timed against a dense GEMM; one nvcc command, run on an sm_90 GPU (make gmm-sm90-harness).
$(BUILD)/bench/gmm_sm90_harness: bench/gmm_sm90_harness.cu kernels/cuda/grouped_matmul_sm90.cu kernels/cuda/grouped_matmul_sm90.h \
    kernels/cuda/mma.cuh kernels/cuda/swiglu.cuh kernels/cuda/tma.cuh kernels/cuda/wgmma.cuh
	@mkdir -p $(dir $@)
	$(NVCC) -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Ikernels/cuda bench/gmm_sm90_harness.cu \
	    kernels/cuda/grouped_matmul_sm90.cu -L$(CUDA_LIBDIR) -Xlinker -rpath,$(CUDA_LIBDIR) -lcublas -o $@
gmm-sm90-harness: $(BUILD)/bench/gmm_sm90_harness
.PHONY: gmm-sm90-harness
# bench/attn_sm90_harness.cu: the Hopper attention kernels alone (it includes attention_sm90.cu),
# checked against a float64 CPU evaluation and timed per kernel (make attn-sm90-harness).
$(BUILD)/bench/attn_sm90_harness: bench/attn_sm90_harness.cu kernels/cuda/attention_sm90.cu kernels/cuda/attention_sm90.h \
    kernels/cuda/mma.cuh kernels/cuda/tma.cuh kernels/cuda/wgmma.cuh
	@mkdir -p $(dir $@)
	$(NVCC) -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Ikernels/cuda bench/attn_sm90_harness.cu -o $@
attn-sm90-harness: $(BUILD)/bench/attn_sm90_harness
.PHONY: attn-sm90-harness
endif
.PHONY: bench-tools

.PHONY: bench
bench: $(BENCH_BIN)
	TM_BENCH_BIN=$(BENCH_BIN) bench/run.sh $(BENCH_ARGS)

# bench/tokenizer.sh (issue 23): the driver's BPE encoder and trainer (build/bench/tokenizer,
# bench/tokenizer.c) against the `tokenizers` package on the same files.
$(BUILD)/bench/tokenizer: bench/tokenizer.c $(LIBTRAIN) $(LIBA)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -Itrain $(CJSON_CFLAGS) -o $@ $< $(LIBTRAIN) $(LIBA) $(LDLIBS_ALL) $(CJSON_LIBS) $(PCRE2_LIBS) $(UTF8PROC_LIBS)
all: $(BUILD)/bench/tokenizer

# The GPU benchmarks of issue 12 (bench/gpu.sh, docs/PERFORMANCE.md): built by `make` on every
# machine, so that CI compiles them; without a CUDA device they refuse --device cuda with a
# message (exit 3) and run only as CPU smoke tests (--device cpu, bench/gpu.sh --smoke).
# `make bench-gpu` builds them with the driver and runs bench/gpu.sh (BENCH_ARGS: --quick, ...).
BENCH_GPU_BIN := $(BUILD)/bench/moe_layer $(BUILD)/bench/kernels $(BUILD)/bench/attention
all: $(BENCH_GPU_BIN)
$(BENCH_GPU_BIN): $(BUILD)/bench/%: bench/%.c bench/bench.h $(LIBA)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -o $@ $< $(LIBA) $(LDLIBS_ALL)

# bench/ckpt_io.c (issue 21): checkpoint save / load GB/s beside raw file I/O of the same bytes;
# `make bench-ckpt` (bench/ckpt_io.sh; BENCH_ARGS: --preset coarse --device cuda, --dir DIR, ...).
CKPT_BENCH_BIN := $(BUILD)/bench/ckpt_io
all: $(CKPT_BENCH_BIN)
$(CKPT_BENCH_BIN): bench/ckpt_io.c $(LIBA)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -o $@ $< $(LIBA) $(LDLIBS_ALL)

.PHONY: bench-ckpt
bench-ckpt: $(CKPT_BENCH_BIN) $(BIN)
	bash bench/ckpt_io.sh $(BENCH_ARGS)

.PHONY: bench-gpu
bench-gpu: $(BENCH_GPU_BIN) $(BIN)
	bash bench/gpu.sh --no-build $(BENCH_ARGS)
