package main

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/shuntnet/shunt/internal/testenv"
)

func TestDebVersion(t *testing.T) {
	for _, tc := range []struct{ describe, want string }{
		{"v1.2.3", "1.2.3"},
		{"1.2", "1.2"},
		{"v1.2.3-dirty", "1.2.3+dirty"},
		{"v1.2.3-4-gabc1234", "1.2.3+4.gabc1234"},
		{"v1.2.3-4-gabc1234-dirty", "1.2.3+4.gabc1234.dirty"},
		{"abc1234", "0.0.0+gabc1234"},
		{"ffd8b60-dirty", "0.0.0+gffd8b60.dirty"},
	} {
		t.Run(tc.describe, func(t *testing.T) {
			got, err := debVersion(tc.describe)
			if err != nil || got != tc.want {
				t.Errorf("debVersion(%q) = %q, %v; want %q", tc.describe, got, err, tc.want)
			}
		})
	}
	for _, bad := range []string{"", "v1.2.3-rc1", "release", "v1..2"} {
		if got, err := debVersion(bad); err == nil {
			t.Errorf("debVersion(%q) = %q; want an error", bad, got)
		}
	}
}

func TestGlibcVersion(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []int
		ok   bool
	}{
		{"GLIBC_2.34", []int{2, 34}, true},
		{"GLIBC_2.2.5", []int{2, 2, 5}, true},
		{"GLIBC_PRIVATE", nil, false},
		{"GCC_3.0", nil, false},
		{"", nil, false},
	} {
		got, ok := glibcVersion(tc.in)
		if ok != tc.ok || !slices.Equal(got, tc.want) {
			t.Errorf("glibcVersion(%q) = %v, %v; want %v, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
	if !versionLess([]int{2, 2, 5}, []int{2, 34}) || versionLess([]int{2, 34}, []int{2, 3, 4}) || !versionLess(nil, []int{2}) {
		t.Error("versionLess orders versions wrongly")
	}
}

// TestUnitRunsPackagedHostd: the unit starts hostd where shunt-host puts it.
func TestUnitRunsPackagedHostd(t *testing.T) {
	f, err := os.Open("../hostd/dist/shunt-hostd.service")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var execStart string
	for sc := bufio.NewScanner(f); sc.Scan(); {
		if v, ok := strings.CutPrefix(sc.Text(), "ExecStart="); ok {
			execStart = v
		}
	}
	if want := hostdPath + " agent -config " + configPath; execStart != want {
		t.Errorf("unit: ExecStart=%s, want ExecStart=%s", execStart, want)
	}
}

// TestShuntRunFindsPackagedLibrary: shunt-run, installed where shunt-guest
// puts it, finds the library where shunt-guest puts it. The layout is
// rebuilt under a temporary root, so this needs no root and no package.
func TestShuntRunFindsPackagedLibrary(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skipf("the package is amd64 (x86_64-linux-gnu); this is %s", runtime.GOARCH)
	}
	root := t.TempDir()
	run, lib := filepath.Join(root, shuntRunPath), filepath.Join(root, preloadPath)
	src, err := os.ReadFile("../guestlib/preload/shunt-run")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{run, lib} {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(run, src, 0o755); err != nil {
		t.Fatal(err)
	}
	// An empty file: the loader ignores it (and says so on stderr), and
	// the shell prints what shunt-run chose.
	if err := os.WriteFile(lib, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(run, "sh", "-c", `printf %s "$LD_PRELOAD"`)
	cmd.Env = withoutPreload(os.Environ())
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("shunt-run: %v", err)
	}
	got, err := filepath.EvalSymlinks(string(out))
	if err != nil {
		t.Fatalf("shunt-run chose %q: %v", out, err)
	}
	if want, _ := filepath.EvalSymlinks(lib); got != want {
		t.Errorf("shunt-run chose %s, want %s", got, want)
	}
}

// TestUdevRuleMatchesVagrant: the packaged udev rule is the one the Vagrant
// rig's provisioning writes.
func TestUdevRuleMatchesVagrant(t *testing.T) {
	rules := func(text string) []string {
		var out []string
		for _, l := range strings.Split(text, "\n") {
			if strings.HasPrefix(l, "SUBSYSTEM==") {
				out = append(out, l)
			}
		}
		return out
	}
	pkg, err := os.ReadFile("guest/70-shunt.rules")
	if err != nil {
		t.Fatal(err)
	}
	prov, err := os.ReadFile("../vagrant/provision.sh")
	if err != nil {
		t.Fatal(err)
	}
	got, want := rules(string(pkg)), rules(string(prov))
	if len(want) == 0 || !slices.Equal(got, want) {
		t.Errorf("guest/70-shunt.rules has\n%s\nvagrant/provision.sh writes\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// TestPackageContents builds both packages with make deb and checks what
// each installs, its conffiles and its relationships.
func TestPackageContents(t *testing.T) {
	testenv.NeedTool(t, "dpkg-deb", "dpkg")
	debs := buildDebs(t)
	for _, tc := range []struct {
		pkg     string
		files   map[string]string // path: mode as dpkg-deb -c shows it
		depends string
		conf    string
	}{
		{"shunt-host", map[string]string{
			hostdPath: "-rwxr-xr-x", unitPath: "-rw-r--r--", configPath: "-rw-------",
			dashboardPath: "-rw-r--r--", "/usr/share/doc/shunt-host/README.md": "-rw-r--r--",
			cniPath: "-rwxr-xr-x", cdiPath: "-rw-r--r--", containersDoc: "-rw-r--r--",
		}, "libc6 (>= 2.", cdiPath + "\n" + configPath},
		{"shunt-guest", map[string]string{
			shuntRunPath: "-rwxr-xr-x", preloadPath: "-rw-r--r--", udevRulePath: "-rw-r--r--",
			vstretchdPath: "-rwxr-xr-x", vstretchdUnit: "-rw-r--r--",
		}, "libc6 (>= 2.", ""},
	} {
		t.Run(tc.pkg, func(t *testing.T) {
			deb := debs[tc.pkg]
			out, err := exec.Command("dpkg-deb", "-c", deb).Output()
			if err != nil {
				t.Fatalf("dpkg-deb -c %s: %v", deb, err)
			}
			got := map[string]string{}
			for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
				f := strings.Fields(l)
				got[strings.TrimPrefix(f[len(f)-1], ".")] = f[0]
			}
			for p, mode := range tc.files {
				if got[p] != mode {
					t.Errorf("%s: %s has mode %q, want %q", tc.pkg, p, got[p], mode)
				}
			}
			for p := range got {
				if strings.HasPrefix(p, "/usr/local") {
					t.Errorf("%s installs %s: packages stay out of /usr/local", tc.pkg, p)
				}
			}
			fields, err := exec.Command("dpkg-deb", "-f", deb, "Architecture", "Depends").Output()
			if err != nil {
				t.Fatal(err)
			}
			if s := string(fields); !strings.Contains(s, "Architecture: amd64") || !strings.Contains(s, tc.depends) {
				t.Errorf("%s control fields:\n%s\nwant Architecture: amd64 and Depends on %s...", tc.pkg, s, tc.depends)
			}
			conf, err := exec.Command("dpkg-deb", "--info", deb, "conffiles").Output()
			if tc.conf == "" {
				if err == nil && len(conf) > 0 {
					t.Errorf("%s has conffiles %q, want none", tc.pkg, conf)
				}
				return
			}
			if strings.TrimSpace(string(conf)) != tc.conf {
				t.Errorf("%s conffiles: %q, want %s", tc.pkg, conf, tc.conf)
			}
		})
	}
}

var debsOnce struct {
	sync.Once
	dir  string
	debs map[string]string
	err  string
}

// buildDebs runs make deb into a directory of its own, once per test
// binary, and returns the packages by name.
func buildDebs(t *testing.T) map[string]string {
	t.Helper()
	testenv.NeedTool(t, "make", "make")
	testenv.NeedTool(t, "gcc", "gcc libc6-dev")
	debsOnce.Do(func() {
		dir, err := os.MkdirTemp("", "shunt-deb-test-")
		if err != nil {
			debsOnce.err = err.Error()
			return
		}
		debsOnce.dir = dir
		cmd := exec.Command("make", "-s", "-C", "..", "deb", "BIN="+dir)
		out, err := cmd.CombinedOutput()
		if err != nil {
			debsOnce.err = "make deb: " + err.Error() + "\n" + string(out)
			return
		}
		debsOnce.debs = map[string]string{}
		for _, name := range []string{"shunt-host", "shunt-guest"} {
			m, _ := filepath.Glob(filepath.Join(dir, name+"_*_amd64.deb"))
			if len(m) != 1 {
				debsOnce.err = "make deb made " + strings.Join(m, ", ") + " for " + name + "; want one package:\n" + string(out)
				return
			}
			debsOnce.debs[name] = m[0]
		}
	})
	if debsOnce.err != "" {
		t.Fatal(debsOnce.err)
	}
	return debsOnce.debs
}

func TestMain(m *testing.M) {
	code := m.Run()
	if debsOnce.dir != "" {
		os.RemoveAll(debsOnce.dir)
	}
	os.Exit(code)
}

// withoutPreload is env without what would choose or preload the library
// for shunt-run, so it has to find the library itself.
func withoutPreload(env []string) []string {
	return slices.DeleteFunc(slices.Clone(env), func(kv string) bool {
		return strings.HasPrefix(kv, "SHUNT_PRELOAD=") || strings.HasPrefix(kv, "LD_PRELOAD=")
	})
}

// TestUnitRunsPackagedVsockd: shunt-vsockd's unit starts it where
// shunt-host puts it, on the socket the example configuration names.
func TestUnitRunsPackagedVsockd(t *testing.T) {
	unit, err := os.ReadFile("../hostd/dist/shunt-vsockd.service")
	if err != nil {
		t.Fatal(err)
	}
	hcl, err := os.ReadFile("../hostd/dist/hostd.hcl")
	if err != nil {
		t.Fatal(err)
	}
	const sock = "/run/shunt/vsockd.sock"
	if want := "ExecStart=" + vsockdPath + " -socket " + sock + "\n"; !strings.Contains(string(unit), want) {
		t.Errorf("unit: want %q", want)
	}
	if want := "vsockd_socket = \"" + sock + "\""; !strings.Contains(string(hcl), want) {
		t.Errorf("hostd.hcl: want a line saying %s", want)
	}
}
