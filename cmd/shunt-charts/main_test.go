package main

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestRun(t *testing.T) {
	in := filepath.Join("..", "..", "internal", "benchchart", "testdata")
	for _, tc := range []struct {
		name    string
		args    []string
		files   []string // charts written, in order
		stderr  string   // substring of stderr; "" for none at all
		wantErr string
	}{{
		name:  "shm",
		args:  []string{"-cmd", "make bench-shm", filepath.Join(in, "shm.txt")},
		files: []string{"shm-latency.svg", "shm-bandwidth.svg", "shm-ringsize.svg", "shm-idle-cpu.svg"},
	}, {
		name:  "vm",
		args:  []string{filepath.Join(in, "vm.txt")},
		files: []string{"vm-latency.svg", "vm-bandwidth.svg"},
	}, {
		name:   "unknown figures are reported, known ones charted",
		args:   []string{"INPUT:BenchmarkGuestSetup/shunt-2 \t 1 \t 5 ns/op \t 900 us/setup\nBenchmarkMystery-2 \t 1 \t 5 ns/op \t 7 widgets/s\nBenchmarkBroken-2 x\n"},
		files:  []string{"e2e-setup.svg"},
		stderr: "BenchmarkMystery widgets/s: no rule for this unit",
	}, {
		name:    "no results",
		args:    []string{"INPUT:PASS\n"},
		wantErr: "no benchmark results",
	}, {
		name:    "no chart has data",
		args:    []string{"INPUT:BenchmarkMystery-2 \t 1 \t 5 ns/op\n"},
		wantErr: "no chart has data",
	}, {
		name:    "no input",
		wantErr: "no input",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			out := filepath.Join(dir, "charts")
			args := []string{"-o", out}
			for _, a := range tc.args {
				if text, ok := strings.CutPrefix(a, "INPUT:"); ok {
					a = filepath.Join(dir, "bench.txt")
					if err := os.WriteFile(a, []byte(text), 0o644); err != nil {
						t.Fatal(err)
					}
				}
				args = append(args, a)
			}
			var stdout, stderr bytes.Buffer
			err := run(args, &stdout, &stderr)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("run: got error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("run: %v\nstderr: %s", err, stderr.String())
			}
			if tc.stderr == "" && stderr.Len() != 0 {
				t.Errorf("stderr: got %q, want nothing", stderr.String())
			}
			if !strings.Contains(stderr.String(), tc.stderr) {
				t.Errorf("stderr: got %q, want it to contain %q", stderr.String(), tc.stderr)
			}
			var wantOut []string
			for _, f := range tc.files {
				wantOut = append(wantOut, "wrote "+filepath.Join(out, f))
			}
			if got := strings.Split(strings.TrimSpace(stdout.String()), "\n"); !slices.Equal(got, wantOut) {
				t.Errorf("stdout:\n got %q\nwant %q", got, wantOut)
			}
			entries, err := os.ReadDir(out)
			if err != nil {
				t.Fatal(err)
			}
			var names []string
			for _, e := range entries {
				names = append(names, e.Name())
			}
			want := slices.Sorted(slices.Values(tc.files))
			if !slices.Equal(names, want) {
				t.Errorf("files: got %v, want %v", names, want)
			}
		})
	}
}
