# Shunt: `make help` lists the targets.
GO          ?= go
STATICCHECK ?= $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2
BENCHSTAT   ?= $(GO) run golang.org/x/perf/cmd/benchstat@v0.0.0-20260908200009-22c9c6c9d4da
BENCHCOUNT  ?= 8
BIN         := bin

.PHONY: help build preload demo test test-short check fmt vet staticcheck bench bench-shm bench-e2e bench-preload bench-vm fuzz clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

build: ## build every package, and the commands into bin/
	$(GO) build ./...
	$(GO) build -o $(BIN)/ ./cmd/...
	$(MAKE) --no-print-directory preload

CFLAGS ?= -std=c11 -O2 -Wall -Wextra -Werror -fPIC
PRELOAD_SRC := $(wildcard guestlib/preload/csrc/*.c)

preload: ## build the LD_PRELOAD library and shunt-run into bin/ (gcc)
	@mkdir -p $(BIN)
	$(CC) $(CFLAGS) -shared -o $(BIN)/libshunt-preload.so $(filter-out %/xtest.c,$(PRELOAD_SRC)) -ldl -lpthread
	install -m 0755 guestlib/preload/shunt-run $(BIN)/shunt-run

demo: build ## quick start: two guests on this host, kernel TCP vs Shunt, a table (root)
	$(BIN)/shunt-demo $(DEMOFLAGS)

test: ## run all tests (privileged ones need root; under CI=true they fail instead of skipping)
	$(GO) test -timeout 30m ./...

test-short: ## quick unprivileged tests
	$(GO) test -short ./...

check: fmt vet staticcheck ## gofmt + vet + staticcheck

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

bench-e2e: ## guest-to-guest benchmarks, kernel TCP vs Shunt, interleaved rounds (root)
	$(GO) test -c -o $(BIN)/integration.test ./integration/
	@rm -f $(BIN)/bench-e2e.txt
	cd integration && for i in $$(seq $(BENCHCOUNT)); do ../$(BIN)/integration.test -test.run '^$$' -test.bench Guest -test.benchtime 1s >> ../$(BIN)/bench-e2e.txt || exit 1; done
	$(BENCHSTAT) $(BIN)/bench-e2e.txt

bench-preload: ## sockperf, iperf3 and Open MPI with and without shunt-run, and vader (root)
	$(GO) test -c -o $(BIN)/integration.test ./integration/
	@rm -f $(BIN)/bench-preload.txt
	cd integration && for i in $$(seq 3); do ../$(BIN)/integration.test -test.run '^$$' -test.bench '^BenchmarkPreload' -test.benchtime 1x >> ../$(BIN)/bench-preload.txt || exit 1; done
	$(BENCHSTAT) $(BIN)/bench-preload.txt

bench-vm: ## two QEMU (TCG) VMs: ping-pong and stream, the Go library and unmodified programs, virtio-net TCP vs Shunt (root)
	$(GO) test -c -o $(BIN)/integration.test ./integration/
	@rm -f $(BIN)/bench-vm.txt
	cd integration && for i in $$(seq 3); do ../$(BIN)/integration.test -test.run '^$$' -test.bench '^BenchmarkVM' -test.benchtime 1x >> ../$(BIN)/bench-vm.txt || exit 1; done
	$(BENCHSTAT) $(BIN)/bench-vm.txt

fuzz: ## run each fuzz target for FUZZTIME (default 30s)
	@for t in FuzzAttach FuzzIndices; do $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $${FUZZTIME:-30s} ./shm/ring || exit 1; done
	@for t in FuzzHeader FuzzEntry; do $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $${FUZZTIME:-30s} ./shm/region || exit 1; done
	$(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $${FUZZTIME:-30s} ./internal/proto
	$(GO) test -run '^$$' -fuzz '^FuzzParseMessages$$' -fuzztime $${FUZZTIME:-30s} ./hostd/ctrack
	$(GO) test -run '^$$' -fuzz '^FuzzParseDomain$$' -fuzztime $${FUZZTIME:-30s} ./hostd/virt

clean: ## remove build outputs
	rm -rf $(BIN)
