package agent

import (
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/internal/testenv"
)

func TestShareRegionGivesFileToGroup(t *testing.T) {
	grp, err := user.LookupGroupId(strconv.Itoa(os.Getgid()))
	if err != nil {
		testenv.Missing(t, fmt.Sprintf("gid %d has no group name (%v)", os.Getgid(), err), "run as a user whose primary group is in /etc/group")
	}
	path := filepath.Join(t.TempDir(), "region")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := shareRegion(config.Group{Name: "t", Region: path, RegionGroup: grp.Name}); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o660 || int(st.Sys().(*syscall.Stat_t).Gid) != os.Getgid() {
		t.Fatalf("mode %v gid %d, want 0660 and %d", st.Mode().Perm(), st.Sys().(*syscall.Stat_t).Gid, os.Getgid())
	}
	err = shareRegion(config.Group{Name: "t", Region: path, RegionGroup: "no-such-group-shunt"})
	if err == nil || !strings.Contains(err.Error(), "region_group") {
		t.Fatalf("unknown group: err = %v", err)
	}
}
