package relay

import (
	"os"
	"path/filepath"
	"testing"
)

// TestRDMADevices: a sysfs tree like rxe's (an active Ethernet port with
// a link-local v1 and v2 GID and an IPv4-mapped v2 GID, unused entries
// zero) lists the device, and the link picks the IPv4 RoCE v2 GID; a
// down port or a missing tree gives nothing to pick, without error.
func TestRDMADevices(t *testing.T) {
	root := t.TempDir()
	put := func(rel, s string) {
		p := filepath.Join(root, rel)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(s+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	port := "rxe0/ports/1/"
	put(port+"state", "4: ACTIVE")
	put(port+"link_layer", "Ethernet")
	gids := []string{"fe80:0000:0000:0000:5054:00ff:fe12:3401", "fe80:0000:0000:0000:5054:00ff:fe12:3401",
		"0000:0000:0000:0000:0000:ffff:0a63:0001", "0000:0000:0000:0000:0000:ffff:0a63:0001", "0000:0000:0000:0000:0000:0000:0000:0000"}
	types := []string{"IB/RoCE v1", "RoCE v2", "IB/RoCE v1", "RoCE v2", ""}
	for i, g := range gids {
		put(port+"gids/"+string(rune('0'+i)), g)
		if types[i] != "" {
			put(port+"gid_attrs/types/"+string(rune('0'+i)), types[i])
			put(port+"gid_attrs/ndevs/"+string(rune('0'+i)), "eth0")
		}
	}
	put("mlx5_0/ports/1/state", "1: DOWN")
	put("mlx5_0/ports/1/link_layer", "Ethernet")
	devs, err := RDMADevices(root)
	if err != nil || len(devs) != 2 {
		t.Fatalf("%+v, %v", devs, err)
	}
	rxe := devs[1]
	if rxe.Name != "rxe0" || len(rxe.Ports) != 1 || rxe.Ports[0].State != "ACTIVE" || len(rxe.Ports[0].GIDs) != 4 ||
		rxe.Ports[0].GIDs[3].Netdev != "eth0" || rxe.Ports[0].GIDs[3].Type != "RoCE v2" {
		t.Fatalf("rxe0: %+v", rxe)
	}
	if d, p, g, ok := PickRDMA(devs, ""); !ok || d != "rxe0" || p != 1 || g != 3 {
		t.Fatalf("picked %s port %d gid %d (%v), want rxe0 1 3", d, p, g, ok)
	}
	if _, _, _, ok := PickRDMA(devs, "mlx5_0"); ok {
		t.Fatal("picked a down port")
	}
	if devs, err := RDMADevices(filepath.Join(root, "none")); err != nil || devs != nil {
		t.Fatalf("missing tree: %v, %v", devs, err)
	}
}
