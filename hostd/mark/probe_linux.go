//go:build linux

package mark

import (
	"fmt"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"
)

// Probe checks that hostd can install its table in the network namespace
// at netns ("" = the caller's own): it sends, in one batch, a table with
// hostd's chains and one rule of hostd's kind, and that table's deletion,
// so nothing stays and a running hostd's table is not touched. It returns
// the number of rules per chain in hostd's own table, or -1 if there is
// none (no hostd runs there).
func Probe(netns string) (installed int, err error) {
	var opts []nftables.ConnOption
	if netns != "" {
		fd, err := unix.Open(netns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return 0, fmt.Errorf("open netns %s: %w", netns, err)
		}
		defer unix.Close(fd)
		opts = append(opts, nftables.WithNetNSFd(fd))
	}
	c, err := nftables.New(opts...)
	if err != nil {
		return 0, fmt.Errorf("nftables netlink: %w%s", err, hint(err))
	}
	t := &nftables.Table{Name: Table + "_check", Family: nftables.TableFamilyINet}
	c.AddTable(t)
	f := Field{DefaultMask}
	for _, ch := range chains(t) {
		c.AddChain(ch)
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: Exprs(f, Entry{Ifname: "shunt-check0", ID: 1, Value: f.Value(1)})})
	}
	c.DelTable(t)
	if err := c.Flush(); err != nil {
		return 0, fmt.Errorf("install a table like hostd's: %w%s", err, hint(err))
	}
	if _, err := c.ListTableOfFamily(Table, nftables.TableFamilyINet); err != nil {
		return -1, nil // no such table (the error is ENOENT, as a string)
	}
	own := table()
	rules, err := c.GetRules(own, chains(own)[0])
	if err != nil {
		return 0, fmt.Errorf("list hostd's table: %w", err)
	}
	return len(rules), nil
}
