package agent

import (
	"errors"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/shm/region"
)

// TestGroupRegionGivenToGroup: with region_group, hostd creates the group
// region 0660 for that group, and adopts it (and gives it to the group
// again) after a restart.
func TestGroupRegionGivenToGroup(t *testing.T) {
	grp, err := user.LookupGroupId(strconv.Itoa(os.Getgid()))
	if err != nil {
		testenv.Missing(t, fmt.Sprintf("gid %d has no group name (%v)", os.Getgid(), err), "run as a user whose primary group is in /etc/group")
	}
	dir := t.TempDir()
	files, err := region.OpenFiles(filepath.Join(dir, "state"))
	if err != nil {
		t.Fatal(err)
	}
	g := config.Group{Name: "t/x", Region: filepath.Join(dir, "region"), RegionGroup: grp.Name,
		Geometry: region.Geometry{Size: 1 << 20, Slots: 8}}
	acc, err := regionAccess(g)
	if err != nil {
		t.Fatal(err)
	}
	for i, wantAdopted := range []bool{false, true} {
		pool, adopted, err := openGroupRegion(hclog.NewNullLogger(), files, g, acc)
		if err != nil {
			t.Fatalf("open %d: %v", i, err)
		}
		pool.Close()
		st, err := os.Stat(g.Region)
		if err != nil {
			t.Fatal(err)
		}
		if adopted != wantAdopted || st.Mode().Perm() != 0o660 || int(st.Sys().(*syscall.Stat_t).Gid) != os.Getgid() {
			t.Fatalf("open %d: adopted %v, mode %v gid %d; want adopted %v, 0660 and gid %d", i, adopted, st.Mode().Perm(), st.Sys().(*syscall.Stat_t).Gid, wantAdopted, os.Getgid())
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "state", "group-t%2Fx.state")); err != nil {
		t.Fatalf("no shadow under its escaped name: %v", err)
	}
	_, err = regionAccess(config.Group{Name: "t", Region: g.Region, RegionGroup: "no-such-group-shunt"})
	if err == nil || !strings.Contains(err.Error(), "region_group") {
		t.Fatalf("unknown group: err = %v", err)
	}
}

// TestGroupRegionNotOurs: a file at a group region's path that hostd did
// not create (no shadow) is refused with what to remove, and left alone.
func TestGroupRegionNotOurs(t *testing.T) {
	dir := t.TempDir()
	files, err := region.OpenFiles(filepath.Join(dir, "state"))
	if err != nil {
		t.Fatal(err)
	}
	g := config.Group{Name: "t", Region: filepath.Join(dir, "region"), Geometry: region.Geometry{Size: 1 << 20, Slots: 8}}
	if err := os.WriteFile(g.Region, []byte("squatter"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, _, err = openGroupRegion(hclog.NewNullLogger(), files, g, region.NoGroup)
	if !errors.Is(err, region.ErrNotOurs) || !strings.Contains(err.Error(), "rm "+g.Region) {
		t.Fatalf("open over a file hostd did not make: %v; want ErrNotOurs saying rm %s", err, g.Region)
	}
	if b, _ := os.ReadFile(g.Region); string(b) != "squatter" {
		t.Fatalf("the file was changed: %q", b)
	}
}
