package vagrant

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/vhost"
	"github.com/shuntnet/shunt/vhost/ivshmem"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// TestDeviceArgsMatchVhost: the Vagrantfile's QEMU arguments are exactly
// what vhost generates for the same region and socket.
func TestDeviceArgsMatchVhost(t *testing.T) {
	b, err := os.ReadFile("Vagrantfile")
	if err != nil {
		t.Fatal(err)
	}
	block := regexp.MustCompile(`(?s)# shunt:qemuargs:begin(.*)# shunt:qemuargs:end`).FindSubmatch(b)
	if block == nil {
		t.Fatal("no shunt:qemuargs block in the Vagrantfile")
	}
	var got []string
	for _, m := range regexp.MustCompile(`:value => "([^"]*)"`).FindAllSubmatch(block[1], -1) {
		s := strings.NewReplacer("#{REGION}", "/dev/shm/shunt-tenant", "#{REGION_SIZE}", "67108864", "#{name}", "g1").Replace(string(m[1]))
		got = append(got, s)
	}
	want, err := vhost.Attachment{
		Region:  ivshmem.Device{ID: "shunt0", Path: "/dev/shm/shunt-tenant", Size: 64 << 20},
		Control: vserial.Port{ID: "shunt0", Socket: "/run/shunt/g1.sock", Ports: 2},
	}.QEMUArgs()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("Vagrantfile args\n %s\nvhost generates\n %s", strings.Join(got, " "), strings.Join(want, " "))
	}
}

func TestHostdConfigParses(t *testing.T) {
	c, err := config.Load("hostd.hcl")
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Guests) != 2 || c.Guests[0].Ports != 2 || c.Guests[1].Ports != 2 || c.Groups[0].Region != "/dev/shm/shunt-tenant" || c.Groups[0].Geometry.Size != 64<<20 {
		t.Fatalf("hostd.hcl does not match the Vagrantfile: %+v", c)
	}
}

func TestSyntax(t *testing.T) {
	if out, err := exec.Command("sh", "-n", "provision.sh").CombinedOutput(); err != nil {
		t.Fatalf("provision.sh: %v\n%s", err, out)
	}
	testenv.NeedTool(t, "ruby", "ruby")
	if out, err := exec.Command("ruby", "-c", "Vagrantfile").CombinedOutput(); err != nil {
		t.Fatalf("Vagrantfile: %v\n%s", err, out)
	}
}
