# Shunt: `make help` lists the targets.
GO          ?= go
STATICCHECK ?= $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2
BENCHSTAT   ?= $(GO) run golang.org/x/perf/cmd/benchstat@v0.0.0-20260908200009-22c9c6c9d4da
BENCHCOUNT  ?= 8
BIN         := bin

.PHONY: help build test test-short check fmt vet staticcheck bench bench-shm fuzz clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

build: ## build every package and the commands into bin/
	$(GO) build ./...

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

bench: bench-shm ## run all benchmarks (see docs/BENCHMARKS.md)

# The machines move between cache placements over seconds, so whole suites
# are interleaved (BENCHCOUNT rounds of every benchmark) rather than running
# one benchmark BENCHCOUNT times in a row; benchstat then takes medians.
bench-shm: ## cross-process ring benchmarks, medians of BENCHCOUNT interleaved rounds
	$(GO) test -c -o $(BIN)/shm.test ./shm/
	@rm -f $(BIN)/bench-shm.txt
	for i in $$(seq $(BENCHCOUNT)); do $(BIN)/shm.test -test.run '^$$' -test.bench . -test.benchtime 200ms >> $(BIN)/bench-shm.txt || exit 1; done
	$(BENCHSTAT) $(BIN)/bench-shm.txt

fuzz: ## run each fuzz target for FUZZTIME (default 30s)
	@for t in FuzzAttach FuzzIndices; do $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $${FUZZTIME:-30s} ./shm/ring || exit 1; done
	@for t in FuzzHeader FuzzEntry; do $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $${FUZZTIME:-30s} ./shm/region || exit 1; done

clean: ## remove build outputs
	rm -rf $(BIN)
