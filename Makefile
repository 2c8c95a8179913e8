# Shunt: `make help` lists the targets.
GO          ?= go
STATICCHECK ?= $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2
BENCHSTAT   ?= $(GO) run golang.org/x/perf/cmd/benchstat@v0.0.0-20260908200009-22c9c6c9d4da
BENCHCOUNT  ?= 8
BIN         := bin

.PHONY: core-syms help build preload ctest deps-demo deps-test demo test test-rdma test-short check fmt vet staticcheck bench bench-shm bench-e2e bench-sizes bench-http bench-preload bench-vm bench-cross bench-cross-mpi fuzz clean deb mpi bench-mpi bench-mpi-defaults

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

build: ## build every package, the commands into bin/, and the CNI plugin into bin/cni/shunt
	$(GO) build ./...
	$(GO) build -o $(BIN)/ ./cmd/...
	$(GO) build -o $(BIN)/cni/shunt ./cmd/shunt-cni
	$(MAKE) --no-print-directory preload

# C: the one definition of the compiler flags, for the library and the C test
# programs. The Go tests build C through these targets (make -s preload
# BIN=<dir>, make -s ctest BIN=<dir>), so they use exactly these flags.
ifeq ($(origin CC),default)
CC          := gcc
endif
CFLAGS      ?= -O2
SHUNT_CFLAGS = -std=c11 -Wall -Wextra -Werror -pthread $(CFLAGS)
CORE_DIR    := guestlib/c
CORE_SRC    := $(wildcard $(CORE_DIR)/*.c)
CORE_HDR    := $(wildcard $(CORE_DIR)/*.h)
PRELOAD_SRC := $(wildcard guestlib/preload/csrc/*.c)
PRELOAD_HDR := $(wildcard guestlib/preload/csrc/*.h)

preload: $(BIN)/libshunt-preload.so $(BIN)/shunt-run ## build the LD_PRELOAD library and shunt-run into bin/ (gcc)

$(BIN)/libshunt-preload.so: $(CORE_SRC) $(CORE_HDR) $(PRELOAD_SRC) $(PRELOAD_HDR)
	@mkdir -p $(@D)
	$(CC) $(SHUNT_CFLAGS) -fPIC -shared -fvisibility=hidden -I$(CORE_DIR) -o $@ $(CORE_SRC) $(PRELOAD_SRC) -ldl

$(BIN)/shunt-run: guestlib/preload/shunt-run
	@mkdir -p $(@D)
	install -m 0755 $< $@

# btl/shunt, the Open MPI transport (guestlib/mpi/csrc, docs/mpi.md): the core
# plus the component, against the distribution's Open MPI headers
# (libopenmpi-dev); OMPI_INC and OMPI_LIB point at another Open MPI 4.1.
OMPI_INC    ?= /usr/lib/x86_64-linux-gnu/openmpi/include
OMPI_LIB    ?= /usr/lib/x86_64-linux-gnu/openmpi/lib
MPI_DIR     := guestlib/mpi/csrc
MPI_SRC     := $(wildcard $(MPI_DIR)/*.c)
MPI_HDR     := $(wildcard $(MPI_DIR)/*.h)

mpi: $(BIN)/mca_btl_shunt.so $(BIN)/shunt-mpirun ## build btl/shunt (mca_btl_shunt.so, for Open MPI 4.1) and shunt-mpirun into bin/

$(BIN)/mca_btl_shunt.so: $(CORE_SRC) $(CORE_HDR) $(MPI_SRC) $(MPI_HDR)
	@mkdir -p $(@D)
	$(CC) $(SHUNT_CFLAGS) -fPIC -shared -fvisibility=hidden -I$(CORE_DIR) -isystem $(OMPI_INC) -isystem $(OMPI_INC)/openmpi -o $@ $(CORE_SRC) $(MPI_SRC) -L$(OMPI_LIB) -lopen-pal -ldl

$(BIN)/shunt-mpirun: guestlib/mpi/shunt-mpirun
	@mkdir -p $(@D)
	install -m 0755 $< $@

ctest: $(BIN)/shunt-xtest $(BIN)/shunt-edge $(BIN)/shunt-early $(BIN)/shunt-connrate $(BIN)/shunt-stream ## build the C test programs into bin/: shunt-xtest (cross-language checks, the core's record tests), shunt-edge, shunt-early, shunt-connrate and shunt-stream (integration/ctest)

XTEST_SRC := $(wildcard $(CORE_DIR)/xtest/*.c)

$(BIN)/shunt-xtest: $(XTEST_SRC) $(CORE_SRC) $(CORE_HDR)
	@mkdir -p $(@D)
	$(CC) $(SHUNT_CFLAGS) -I$(CORE_DIR) -o $@ $(XTEST_SRC) $(CORE_SRC)

# A program whose library's constructor does I/O before the preload
# library's constructor runs (early_lib.c); rpath finds the library.
$(BIN)/libshunt-early.so: integration/ctest/early_lib.c
	@mkdir -p $(@D)
	$(CC) $(SHUNT_CFLAGS) -fPIC -shared -o $@ $<

$(BIN)/shunt-early: integration/ctest/early.c $(BIN)/libshunt-early.so
	$(CC) $(SHUNT_CFLAGS) -o $@ $< -L$(BIN) -lshunt-early -Wl,-rpath,'$$ORIGIN'

# The edge suite's servers ignore some write results on purpose.
EDGE_SRC := integration/ctest/edge.c integration/ctest/edge_blocking.c integration/ctest/edge_switch.c integration/ctest/edge_fork.c \
            integration/ctest/edge_epoll.c integration/ctest/edge_raw.c integration/ctest/edge_vfork.c \
            integration/ctest/edge_locks.c integration/ctest/edge_limits.c

$(BIN)/shunt-edge: $(EDGE_SRC) integration/ctest/edge.h
	@mkdir -p $(@D)
	$(CC) $(SHUNT_CFLAGS) -Wno-unused-result -o $@ $(EDGE_SRC)

$(BIN)/shunt-connrate: integration/ctest/connrate.c integration/ctest/tool.h
	@mkdir -p $(@D)
	$(CC) $(SHUNT_CFLAGS) -o $@ $<

$(BIN)/shunt-stream: integration/ctest/stream.c integration/ctest/tool.h
	@mkdir -p $(@D)
	$(CC) $(SHUNT_CFLAGS) -o $@ $<

# Debian packages (packaging/, nfpm as a Go module): shunt-host and
# shunt-guest into bin/, versioned from git describe (or make deb VERSION=1.2.3).
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null)

deb: preload ## build the shunt-host and shunt-guest Debian packages into bin/ (VERSION=...)
	$(GO) build -ldflags='-s -w' -o $(BIN)/hostd ./cmd/hostd
	$(GO) build -ldflags='-s -w' -o $(BIN)/cni/shunt ./cmd/shunt-cni
	CGO_ENABLED=0 $(GO) build -ldflags='-s -w' -o $(BIN)/shunt-vstretchd ./cmd/shunt-vstretchd
	$(GO) build -ldflags='-s -w' -o $(BIN)/shunt-vsockd ./cmd/shunt-vsockd
	$(GO) run ./packaging -version '$(VERSION)' -bin $(BIN) -out $(BIN)

deps-demo: ## install what the demo needs (as root on Debian or Ubuntu; prints the apt-get command otherwise)
	@scripts/deps.sh demo

deps-test: ## install what the tests need (as deps-demo)
	@scripts/deps.sh test

demo: deps-demo build ## quick start: two guests on this host, kernel TCP vs Shunt, a table (root)
	$(BIN)/shunt-demo $(DEMOFLAGS)

# One package's tests at a time (-p 1): the integration packages boot VMs,
# run MPI jobs and time-sensitive switches, and two of them side by side
# on two cores made each other's deadlines flaky. Serial, make test takes
# about 25 minutes.
test: deps-test ## run all tests (privileged ones need root; under CI=true they fail instead of skipping)
	$(GO) test -p 1 -timeout 30m ./...

test-rdma: deps-test ## the RDMA tests alone, with 5 rounds of figures (make test runs one): SoftRoCE between two TCG VMs (root; 3-6 min)
	SHUNT_RDMA_ROUNDS=5 $(GO) test -timeout 20m -count=1 -run 'TestRDMA(SoftRoCE|Hostd|RxeRemoved|MPI)' -v ./integration/rdma

test-short: ## quick unprivileged tests
	$(GO) test -short ./...

check: fmt vet staticcheck core-syms ## gofmt + vet + staticcheck; the C core calls nothing the preload library defines

# The C core (guestlib/c) runs inside the preload library, which
# interposes libc's socket, I/O and syscall() wrappers: the core makes its
# system calls through guestlib/c/sys.c, never through them. Checked here:
# no undefined symbol of the core's objects is one the preload's objects
# define (nm).
core-syms:
	@d=$$(mktemp -d) && trap 'rm -rf "$$d"' EXIT && \
	for f in $(CORE_SRC); do $(CC) $(SHUNT_CFLAGS) -fPIC -fvisibility=hidden -I$(CORE_DIR) -c $$f -o "$$d/core_$$(basename $$f .c).o" || exit 1; done && \
	for f in $(PRELOAD_SRC); do $(CC) $(SHUNT_CFLAGS) -fPIC -fvisibility=hidden -I$(CORE_DIR) -c $$f -o "$$d/preload_$$(basename $$f .c).o" || exit 1; done && \
	nm -g --defined-only "$$d"/preload_*.o | awk 'NF == 3 {print $$3}' | sort -u > "$$d/defined" && \
	nm -u "$$d"/core_*.o | awk '{print $$NF}' | sort -u > "$$d/called" && \
	bad=$$(comm -12 "$$d/defined" "$$d/called") && \
	if [ -n "$$bad" ]; then echo "the C core calls what guestlib/preload defines (make the call through guestlib/c/sys.h):"; echo "$$bad"; exit 1; fi

fmt:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet ./...

staticcheck:
	$(STATICCHECK) ./...

bench: bench-shm bench-e2e bench-preload ## run all benchmarks (see docs/BENCHMARKS.md)

# The machines move between cache placements over seconds, so whole suites
# are interleaved (BENCHCOUNT rounds of every benchmark) rather than running
# one benchmark BENCHCOUNT times in a row; benchstat then takes medians.
bench-shm: ## cross-process ring benchmarks, medians of BENCHCOUNT interleaved rounds
	$(GO) test -c -o $(BIN)/shm.test ./shm/
	@rm -f $(BIN)/bench-shm.txt
	for i in $$(seq $(BENCHCOUNT)); do $(BIN)/shm.test -test.run '^$$' -test.bench . -test.benchtime 200ms >> $(BIN)/bench-shm.txt || exit 1; done
	$(BENCHSTAT) $(BIN)/bench-shm.txt
	$(GO) run ./cmd/shunt-charts -o docs/charts -cmd 'make bench-shm' $(BIN)/bench-shm.txt

# BenchmarkRecordPingPong's C ends are shunt-xtest (shm/records_bench_test.go).
bench-shm: $(BIN)/shunt-xtest
bench-shm: export SHUNT_XTEST = $(abspath $(BIN))/shunt-xtest

bench-e2e: ## guest-to-guest benchmarks, kernel TCP vs Shunt, interleaved rounds (root)
	$(GO) test -c -o $(BIN)/integration.test ./integration/
	@rm -f $(BIN)/bench-e2e.txt
	cd integration && for i in $$(seq $(BENCHCOUNT)); do ../$(BIN)/integration.test -test.run '^$$' -test.bench Guest -test.benchtime 1s >> ../$(BIN)/bench-e2e.txt || exit 1; done
	$(BENCHSTAT) $(BIN)/bench-e2e.txt
	$(GO) run ./cmd/shunt-charts -o docs/charts -cmd 'make bench-e2e' $(BIN)/bench-e2e.txt

bench-sizes: ## read and write sizes 1 KiB-1 MiB: Go, C under shunt-run, kernel TCP, BENCHCOUNT interleaved rounds (root)
	$(GO) test -c -o $(BIN)/integration.test ./integration/
	@rm -f $(BIN)/bench-sizes.txt
	cd integration && for i in $$(seq $(BENCHCOUNT)); do ../$(BIN)/integration.test -test.run '^$$' -test.bench GuestSizes -test.benchtime 1x >> ../$(BIN)/bench-sizes.txt || exit 1; done
	$(BENCHSTAT) $(BIN)/bench-sizes.txt
	$(GO) run ./cmd/shunt-charts -o docs/charts -cmd 'make bench-sizes' $(BIN)/bench-sizes.txt

bench-http: ## net/http over guestlib vs kernel TCP, bodies 1 KiB-1 MiB, BENCHCOUNT interleaved rounds (root)
	$(GO) test -c -o $(BIN)/integration.test ./integration/
	@rm -f $(BIN)/bench-http.txt
	cd integration && for i in $$(seq $(BENCHCOUNT)); do ../$(BIN)/integration.test -test.run '^$$' -test.bench GuestHTTP -test.benchtime 1x >> ../$(BIN)/bench-http.txt || exit 1; done
	$(BENCHSTAT) $(BIN)/bench-http.txt
	$(GO) run ./cmd/shunt-charts -o docs/charts -cmd 'make bench-http' $(BIN)/bench-http.txt

bench-preload: ## sockperf, iperf3 and Open MPI with and without shunt-run, and vader (root)
	$(GO) test -c -o $(BIN)/integration.test ./integration/
	@rm -f $(BIN)/bench-preload.txt
	cd integration && for i in $$(seq 3); do ../$(BIN)/integration.test -test.run '^$$' -test.bench '^BenchmarkPreload' -test.benchtime 1x >> ../$(BIN)/bench-preload.txt || exit 1; done
	$(BENCHSTAT) $(BIN)/bench-preload.txt
	$(GO) run ./cmd/shunt-charts -o docs/charts -cmd 'make bench-preload' $(BIN)/bench-preload.txt

# Open MPI: every transport once per round (MPICOUNT rounds), so vader,
# the TCP BTL and btl/shunt are compared within one run; benchstat medians.
MPICOUNT    ?= 5

bench-mpi: ## Open MPI latency, bandwidth and a stencil kernel: vader, the TCP BTL, TCP under shunt-run, btl/shunt (root)
	$(GO) test -c -o $(BIN)/integration.test ./integration/
	@rm -f $(BIN)/bench-mpi.txt
	cd integration && for i in $$(seq $(MPICOUNT)); do ../$(BIN)/integration.test -test.run '^$$' -test.bench '^BenchmarkMPI(BTL|App)$$' -test.benchtime 1x >> ../$(BIN)/bench-mpi.txt || exit 1; done
	$(BENCHSTAT) $(BIN)/bench-mpi.txt
	$(GO) run ./cmd/shunt-charts -o docs/charts -cmd 'make bench-mpi' $(BIN)/bench-mpi.txt

bench-mpi-defaults: ## btl/shunt with hostd's defaults against vader and the TCP BTL, 8 B latency and alltoall at 2 and 4 ranks, bandwidth at 64 KiB and 1 MiB, MPICOUNT interleaved rounds (root)
	$(GO) test -c -o $(BIN)/integration.test ./integration/
	@rm -f $(BIN)/bench-mpi-defaults.txt
	cd integration && for i in $$(seq $(MPICOUNT)); do ../$(BIN)/integration.test -test.run '^$$' -test.bench '^BenchmarkMPIDefaults$$' -test.benchtime 1x >> ../$(BIN)/bench-mpi-defaults.txt || exit 1; done
	$(BENCHSTAT) $(BIN)/bench-mpi-defaults.txt

bench-cross: ## across two hosts of a fabric: kernel TCP vs Shunt through the relays, BENCHCOUNT interleaved rounds (root)
	$(GO) test -c -o $(BIN)/crosshost.test ./integration/crosshost/
	@rm -f $(BIN)/bench-cross.txt
	cd integration/crosshost && for i in $$(seq $(BENCHCOUNT)); do ../../$(BIN)/crosshost.test -test.run '^$$' -test.bench '^BenchmarkCross' -test.benchtime 2s >> ../../$(BIN)/bench-cross.txt || exit 1; done
	$(BENCHSTAT) $(BIN)/bench-cross.txt
	$(GO) run ./cmd/shunt-charts -o docs/charts -cmd 'make bench-cross' $(BIN)/bench-cross.txt

bench-cross-mpi: ## Open MPI across two hosts of a fabric: btl/tcp vs btl/shunt through the relays, 8 B latency and 1 MiB bandwidth, MPICOUNT interleaved rounds (root)
	$(GO) test -c -o $(BIN)/crosshost.test ./integration/crosshost/
	@rm -f $(BIN)/bench-cross-mpi.txt
	cd integration/crosshost && for i in $$(seq $(MPICOUNT)); do ../../$(BIN)/crosshost.test -test.run '^$$' -test.bench '^BenchmarkMPICross$$' -test.benchtime 1x >> ../../$(BIN)/bench-cross-mpi.txt || exit 1; done
	$(BENCHSTAT) $(BIN)/bench-cross-mpi.txt

bench-vm: ## two QEMU (TCG) VMs: ping-pong and stream, the Go library and unmodified programs, virtio-net TCP vs Shunt (root)
	$(GO) test -c -o $(BIN)/integration.test ./integration/
	@rm -f $(BIN)/bench-vm.txt
	cd integration && for i in $$(seq 3); do ../$(BIN)/integration.test -test.run '^$$' -test.bench '^BenchmarkVM' -test.benchtime 1x >> ../$(BIN)/bench-vm.txt || exit 1; done
	$(BENCHSTAT) $(BIN)/bench-vm.txt
	$(GO) run ./cmd/shunt-charts -o docs/charts -cmd 'make bench-vm' $(BIN)/bench-vm.txt

fuzz: ## run each fuzz target for FUZZTIME (default 30s)
	@for t in FuzzAttach FuzzIndices; do $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $${FUZZTIME:-30s} ./shm/ring || exit 1; done
	$(GO) test -run '^$$' -fuzz '^FuzzRecords$$' -fuzztime $${FUZZTIME:-30s} ./shm/ring
	@for t in FuzzHeader FuzzEntry; do $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $${FUZZTIME:-30s} ./shm/region || exit 1; done
	$(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $${FUZZTIME:-30s} ./internal/proto
	$(GO) test -run '^$$' -fuzz '^FuzzParseMessages$$' -fuzztime $${FUZZTIME:-30s} ./hostd/ctrack
	$(GO) test -run '^$$' -fuzz '^FuzzParseDomain$$' -fuzztime $${FUZZTIME:-30s} ./hostd/virt
	$(GO) test -run '^$$' -fuzz '^FuzzWalk$$' -fuzztime $${FUZZTIME:-30s} ./vhost/virtq
	$(GO) test -run '^$$' -fuzz '^FuzzServe$$' -fuzztime $${FUZZTIME:-30s} ./vhost/vhostuser
	$(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $${FUZZTIME:-30s} ./hostd/vsockd
	@for t in FuzzPackets FuzzHdr; do $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $${FUZZTIME:-30s} ./vhost/vsock || exit 1; done
	@for t in FuzzReadFrame FuzzRDMABatch; do $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $${FUZZTIME:-30s} ./relay || exit 1; done

clean: ## remove build outputs
	rm -rf $(BIN)
